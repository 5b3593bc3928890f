"""Wiring tests for DINOv2 and SigLIP, and where their weights come from.

The models here are tiny and randomly initialised, written by save_pretrained and loaded by the production path
(fluxbooth.likeness.weights, then fluxbooth.likeness.embedders): these are WIRING tests (shapes, pairing, the
pins, the hub), not quality tests; their numbers mean nothing. The hub is tests/support/hub_server.py on 127.0.0.1."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fluxbooth.likeness.embedders import load_dino, load_siglip
from fluxbooth.likeness.weights import DINO, SIGLIP, ModelUnavailable, resolve_weights
from fluxbooth.storage.artifacts import sha256_file
from tests.conftest import REPO_ROOT, load_builder_module
from tests.support.hub_server import HubRepo, HubServer, folder_files, running_hub
from tests.support.likeness_fixtures import offline_environ, tiny_dino, tiny_siglip


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-scoring-models")
    return {"dino": tiny_dino(root / "dino"), "siglip": tiny_siglip(root / "siglip")}


@pytest.fixture
def hub() -> Iterator[HubServer]:
    yield from running_hub()


def images() -> list[Image.Image]:
    return [Image.new("RGB", (64, 48), (40 * index, 100, 50)) for index in range(3)]


def test_dinov2_wiring_gives_one_embedding_row_per_image_from_an_operators_folder(tiny_models: dict[str, Path]) -> None:
    weights = resolve_weights(DINO, {DINO.override_variable: str(tiny_models["dino"])})
    rows = load_dino(weights.folder).embed(images())
    assert rows.shape == (3, 32) and np.isfinite(rows).all()
    assert weights.record.to_json() == {
        "role": "likeness",
        "name": "facebook/dinov2-small",
        "revision": "operator's folder (FLUXBOOTH_LIKENESS_DINO)",
        "sha256": sha256_file(tiny_models["dino"] / "model.safetensors"),
        "licence": "Apache-2.0",
        "status": "used",
        "reason": None,
    }


def test_siglip_wiring_scores_each_image_with_its_own_text(tiny_models: dict[str, Path]) -> None:
    scorer = load_siglip(resolve_weights(SIGLIP, {SIGLIP.override_variable: str(tiny_models["siglip"])}).folder)
    texts = ["a photo of a dog on the beach", "a person in a red coat", "a mug on a table"]
    together = scorer.logits(images(), texts)
    one_by_one = [scorer.logits([image], [text])[0] for image, text in zip(images(), texts, strict=True)]
    assert together == pytest.approx(one_by_one, abs=1e-5)


def test_an_operators_folder_without_weights_makes_the_model_unavailable(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelUnavailable) as raised:
        resolve_weights(DINO, {DINO.override_variable: str(tmp_path)})
    assert (
        str(raised.value)
        == f"FLUXBOOTH_LIKENESS_DINO={tmp_path} lacks model.safetensors: give a folder that save_pretrained wrote"
    )


def test_offline_and_cached_nowhere_the_model_is_unavailable_naming_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ModelUnavailable) as raised:
        resolve_weights(SIGLIP, offline_environ(tmp_path))
    assert "is not on this worker" in str(raised.value) and "downloads are off (HF_HUB_OFFLINE=1)" in str(raised.value)
    assert str(raised.value).endswith("bake it into the image or set FLUXBOOTH_LIKENESS_SIGLIP")


def hub_environ(tmp_path: Path, hub: HubServer) -> dict[str, str]:
    return {**offline_environ(tmp_path), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint}


def test_the_pinned_revision_is_downloaded_held_to_its_sha256_and_found_in_the_cache_afterwards(
    tmp_path: Path, hub: HubServer, tiny_models: dict[str, Path]
) -> None:
    commit = hub.add_repo(HubRepo(DINO.repo_id)).add_commit(folder_files(tiny_models["dino"]))
    pinned = dataclasses.replace(DINO, revision=commit, sha256=sha256_file(tiny_models["dino"] / "model.safetensors"))
    downloaded = resolve_weights(pinned, hub_environ(tmp_path, hub))
    assert downloaded.record.status == "used" and downloaded.record.revision == commit
    assert load_dino(downloaded.folder).embed(images()).shape == (3, 32)
    requests_before = len(hub.requests)
    cached = resolve_weights(pinned, {**hub_environ(tmp_path, hub), "HF_HUB_OFFLINE": "1"})
    assert cached.folder == downloaded.folder and len(hub.requests) == requests_before


def test_a_model_baked_by_the_image_build_is_found_offline_in_the_baked_cache(
    tmp_path: Path, hub: HubServer, tiny_models: dict[str, Path]
) -> None:
    fetch_model = load_builder_module("fetch_model")
    commit = hub.add_repo(HubRepo(DINO.repo_id)).add_commit(folder_files(tiny_models["dino"]))
    pinned = dataclasses.replace(DINO, revision=commit, sha256=sha256_file(tiny_models["dino"] / "model.safetensors"))
    baked = tmp_path / "models"
    fetch_model.fetch_scoring_models(baked, hub.endpoint, ((pinned.repo_id, pinned.revision, pinned.patterns),))

    found = resolve_weights(pinned, {**offline_environ(tmp_path / "empty"), "FLUXBOOTH_BAKED_MODELS_DIR": str(baked)})

    assert found.record.status == "used" and found.folder.is_relative_to(baked)
    assert len(load_dino(found.folder).embed(images())) == 3


def test_downloaded_weights_that_do_not_match_the_pin_make_the_model_unavailable(
    tmp_path: Path, hub: HubServer, tiny_models: dict[str, Path]
) -> None:
    commit = hub.add_repo(HubRepo(DINO.repo_id)).add_commit(folder_files(tiny_models["dino"]))
    with pytest.raises(ModelUnavailable) as raised:
        resolve_weights(dataclasses.replace(DINO, revision=commit), hub_environ(tmp_path, hub))
    assert f"not the pinned {DINO.sha256}" in str(raised.value)


def test_a_hub_without_the_model_makes_it_unavailable(tmp_path: Path, hub: HubServer) -> None:
    # (An unreachable hub takes the same path after the client's own retries, about 23 s: not waited for here.)
    with pytest.raises(ModelUnavailable) as raised:
        resolve_weights(DINO, hub_environ(tmp_path, hub))
    assert str(raised.value).startswith(
        f"facebook/dinov2-small (revision {DINO.revision}) is not on this worker and could "
        f"not be downloaded from {hub.endpoint} (RepositoryNotFoundError"
    )


def test_the_pins_are_full_commits_and_sha256_digests() -> None:
    for model in (DINO, SIGLIP):
        assert len(model.revision) == 40 and len(model.sha256) == 64
        assert set(model.revision + model.sha256) <= set("0123456789abcdef")


def test_the_environment_page_names_both_override_variables() -> None:
    page = (REPO_ROOT / "docs" / "environment.md").read_text()
    assert all(f"`{model.override_variable}`" in page for model in (DINO, SIGLIP))


def test_the_cli_package_loads_no_scoring_library_until_score_runs() -> None:
    import subprocess
    import sys

    probe = "import sys, fluxbooth.cli; print(sorted(m for m in ('torch', 'numpy', 'dlib', 'transformers') if m in sys.modules))"
    completed = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert completed.stdout.strip() == "[]"
