"""Likeness scoring through whole jobs on the tiny model: the real trainer under `accelerate launch`, the real
scoring process (`python -m fluxbooth.likeness`), the report and the upload, as a worker runs them.

The person job trains on views of a public-domain portrait (scikit-image's astronaut; the views are augmentations,
not independent photos) so that dlib finds a face in every photo; the tiny model's renders are noise, in which no
face is found: every step is reported as undetected (a face detection rate of 0, likeness null), never scored as 0.
No DINOv2 or SigLIP weights are on the test machine (offline, empty caches): the section says so per model, and
their numbers (variety, prompt fidelity) are null. The object job gets tiny random DINOv2 and SigLIP models
(wiring only: their numbers mean nothing) so that a step can be chosen and its LoRA kept."""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from fluxbooth.job.run import run_job
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from tests.conftest import REPO_ROOT, worker_environment
from tests.support.factories import make_zip, to_base64
from tests.support.likeness_fixtures import astronaut, offline_environ, tiny_dino, tiny_siglip, views
from tests.support.photos import png_size
from tests.support.result_artifacts import artifact_path

pytestmark = pytest.mark.slow

PROMPTS = ["a photo of sks woman", "sks woman on a beach"]
STEPS, EVERY = 5, 2
# Views dlib finds the face in once the dataset stage has scaled them to cover 256 px.
PHOTO_VIEWS = ("original", "crop_and_scale", "colour_shift", "flip")


def photos_zip() -> bytes:
    members = {}
    for name, image in views(astronaut(), PHOTO_VIEWS).items():
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        members[f"{name}.png"] = buffer.getvalue()
    return make_zip(members)


def likeness_job(
    root: Path,
    model_cache_dir: Path,
    torch_extensions_dir: Path,
    job_id: str,
    models: dict[str, str] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    # This checkout's fluxbooth (src/) and its tests package in the trainer's and the scoring process's environment;
    # no scoring model cached anywhere and nothing downloaded, but the `models` folders the worker points to.
    env = {
        **worker_environment(root, model_cache_dir, torch_extensions_dir),
        **offline_environ(root),
        "PYTHONPATH": os.pathsep.join((str(REPO_ROOT / "src"), str(REPO_ROOT))),
        **(models or {}),
    }
    job_input = {
        "model_name": "sks-woman",
        "base_model": TINY_MODEL_NAME,
        "training_type": "lora",
        "lora_rank": 4,
        "dataset": to_base64(photos_zip()),
        "instance_prompt": "a photo of sks woman",
        "steps": STEPS,
        "resolution": 256,
        "seed": 7,
        "validation_prompts": PROMPTS,
        "validation_steps": EVERY,
        "keep_best_step": True,
        **fields,
    }
    result = asyncio.run(run_job(job_input, job_id=job_id, settings=WorkerSettings.from_environ(env)))
    assert "error" not in result, result
    return result


@pytest.fixture(scope="module")
def person(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> dict[str, Any]:
    return likeness_job(
        tmp_path_factory.mktemp("likeness-person"),
        model_cache_dir,
        torch_extensions_dir,
        "person",
        subject_type="person",
    )


@pytest.fixture(scope="module")
def object_job(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("likeness-object")
    models = {
        "FLUXBOOTH_LIKENESS_DINO": str(tiny_dino(root / "dino")),
        "FLUXBOOTH_LIKENESS_SIGLIP": str(tiny_siglip(root / "siglip")),
    }
    return likeness_job(root, model_cache_dir, torch_extensions_dir, "object", models, subject_type="object")


def step(section: dict[str, Any], number: int) -> dict[str, Any]:
    return next(item for item in section["steps"] if item["step"] == number)


def artifact_names(result: dict[str, Any]) -> set[str]:
    return {artifact["name"] for artifact in result["artifacts"]}


# ---- a person job: no face in the tiny model's renders --------------------------------------------------------------


def test_a_person_job_finishes_with_a_scored_likeness_section_for_step_0_every_validation_step_and_the_final_one(
    person: dict[str, Any],
) -> None:
    section = person["likeness"]
    assert (section["status"], section["subject_type"], section["subject_type_source"]) == (
        "scored",
        "person",
        "request",
    )
    assert [item["step"] for item in section["steps"]] == [0, 2, 4, STEPS]
    assert all(item["renders"] == len(PROMPTS) for item in section["steps"])


def test_renders_without_a_face_are_reported_as_undetected_not_scored(person: dict[str, Any]) -> None:
    for item in person["likeness"]["steps"]:
        assert (item["face_detect_rate"], item["likeness"], item["likeness_se"]) == (0.0, None, None)
    assert all("unscored" in step(person["likeness"], number)["failed_guards"] for number in (2, 4, STEPS))


def test_without_dinov2_and_siglip_weights_the_section_names_them_unavailable_and_their_numbers_are_null(
    person: dict[str, Any],
) -> None:
    models = {model["role"]: model for model in person["likeness"]["models"]}
    assert models["likeness"]["status"] == "used"
    assert (models["variety"]["status"], models["prompt_fidelity"]["status"]) == ("unavailable", "unavailable")
    assert all(item["variety"] is None and item["prompt_fidelity"] is None for item in person["likeness"]["steps"])


def test_with_no_step_scored_the_final_weights_stay_main_and_the_section_says_why(person: dict[str, Any]) -> None:
    section = person["likeness"]
    assert (section["selected_step"], section["main_weights_step"]) == (None, STEPS)
    assert section["selection"].startswith("No step was chosen, the final weights stay main")
    assert "lora/pytorch_lora_weights.safetensors" in artifact_names(person)
    assert not any(name.startswith("final_") for name in artifact_names(person))


def test_the_base_models_renders_are_uploaded_with_the_others(person: dict[str, Any]) -> None:
    assert {f"validation/step-000000/validation_{index:02d}.png" for index in range(len(PROMPTS))} <= artifact_names(
        person
    )


def test_the_report_draws_the_likeness_plot(person: dict[str, Any]) -> None:
    assert png_size(artifact_path(person, "report/likeness.png")) > (0, 0)


def test_scoring_is_a_stage_of_the_job_timed_in_its_metrics(person: dict[str, Any]) -> None:
    assert person["metrics"]["seconds"]["score"] > 0


# ---- an object job with tiny random DINOv2 and SigLIP: a step is chosen and kept -----------------------------------


def stored_steps(result: dict[str, Any], name: str) -> str:
    with safe_open(str(artifact_path(result, name)), "pt") as handle:
        return handle.metadata()["ss_steps"]


def test_an_object_job_with_every_model_scores_every_step_and_the_rule_decides(object_job: dict[str, Any]) -> None:
    section = object_job["likeness"]
    assert [model["status"] for model in section["models"]] == ["used", "used"]
    assert all(item["likeness"] is not None for item in section["steps"])
    # Random models: which step the rule picks means nothing (an earlier one, or the final one where the scores
    # cannot tell them apart: tests/likeness covers the rule), only that the choice is one the rule can make.
    chosen = section["selected_step"]
    assert chosen in (2, 4, STEPS)
    assert section["selection"].startswith("Final weights kept: " if chosen == STEPS else "Chosen: step ")


def test_the_main_lora_in_every_format_holds_the_selected_steps_weights(object_job: dict[str, Any]) -> None:
    # Which files move where when an earlier step is chosen: tests/worker/test_scoring_stage.py.
    chosen = object_job["likeness"]["selected_step"]
    stored = [
        stored_steps(object_job, f"lora/{name}")
        for name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors")
    ]
    assert (stored, object_job["likeness"]["main_weights_step"]) == ([str(chosen)] * 2, chosen)


def test_only_the_chosen_steps_lora_is_uploaded(object_job: dict[str, Any]) -> None:
    assert not any("step_loras" in name for name in artifact_names(object_job))
