"""The captioning stage (`captioning: "missing"`): only photos without a caption file are listed, a caption is
trained on only when it holds the trigger word, the user's caption files are never written over, and a captioner
that cannot caption leaves those photos on the instance prompt with one warning saying why. The jobs below run
the stand-in trainer (tests.support.fake_trainer_module): what is under test is the worker's side."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.captioning import (
    DEFAULT_CAPTION_MODEL,
    DEFAULT_CAPTION_REVISION,
    TINY_CAPTIONER,
    caption_model,
    unavailable_output,
)
from fluxbooth.contract.captions import MAX_CAPTION_CHARS
from fluxbooth.dataset import PreparedDataset
from fluxbooth.job.captioning_stage import accepted_captions, fallback_warning, uncaptioned_images, write_captions
from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from tests.support.factories import dataset_members, make_zip, to_base64
from tests.support.fake_trainer_jobs import job_input
from tests.support.result_artifacts import artifact_path

USER_CAPTION = "a photo of sks dog on a red blanket, by the window"


def prepared(folder: Path, names: list[str], captioned: list[str]) -> PreparedDataset:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"png")
    for name in captioned:
        (folder / name).with_suffix(".txt").write_text("a user's caption\n", encoding="utf-8")
    return PreparedDataset(
        instance_dir=folder,
        class_dir=None,
        instance_images=len(names),
        class_images=0,
        captions=len(captioned),
        skipped={},
        smaller_than_resolution=0,
        uploaded_names={name: f"uploaded-{name}" for name in names},
    )


def test_only_the_photos_without_a_caption_file_are_listed_in_upload_order(tmp_path: Path) -> None:
    dataset = prepared(tmp_path / "instance", ["b.png", "a.png", "c.png"], captioned=["a.png"])

    assert uncaptioned_images(dataset) == ["b.png", "c.png"]


def test_a_caption_is_accepted_only_for_a_listed_photo_with_the_trigger_word_and_within_bounds() -> None:
    output = {
        "status": "captioned",
        "captions": {
            "kept.png": "sks dog,  sitting on grass",
            "no-trigger.png": "dog, sitting on grass",
            "blank.png": "   ",
            "not-text.png": ["sks dog"],
            "too-long.png": "sks dog, " + "x" * MAX_CAPTION_CHARS,
            "unlisted.png": "sks dog, on a sofa",
        },
    }
    listed = ["kept.png", "no-trigger.png", "blank.png", "not-text.png", "too-long.png"]

    assert accepted_captions(output, listed, "sks") == {"kept.png": "sks dog, sitting on grass"}


def test_without_a_trigger_word_any_non_blank_caption_is_accepted() -> None:
    output = {"status": "captioned", "captions": {"a.png": "dog, sitting on grass"}}

    assert accepted_captions(output, ["a.png"], None) == {"a.png": "dog, sitting on grass"}


def test_a_caption_is_never_written_over_a_caption_file_that_is_there(tmp_path: Path) -> None:
    dataset = prepared(tmp_path / "instance", ["a.png", "b.png"], captioned=["a.png"])

    written = write_captions({"a.png": "sks dog, new", "b.png": "sks dog, standing"}, dataset, tmp_path)

    assert written == frozenset({"b.png"})
    assert (dataset.instance_dir / "a.txt").read_text(encoding="utf-8") == "a user's caption\n"
    assert (dataset.instance_dir / "b.txt").read_text(encoding="utf-8") == "sks dog, standing\n"


def test_a_captioner_that_could_not_caption_leaves_one_warning_with_the_count_and_its_reason() -> None:
    warning = fallback_warning(unavailable_output("the captioner x could not be loaded: no such folder"), 3, 1)

    assert warning == (
        "captioning: 2 of 3 photos without a caption file train on the instance prompt: "
        "the captioner x could not be loaded: no such folder"
    )


def test_captions_refused_by_the_job_are_named_as_such_in_the_warning() -> None:
    warning = fallback_warning({"status": "captioned", "captions": {}}, 2, 1)

    assert warning == (
        "captioning: 1 of 2 photos without a caption file train on the instance prompt: "
        "its captions for them were empty, too long, or lacked the trigger word"
    )


def test_no_warning_when_every_listed_photo_was_captioned() -> None:
    assert fallback_warning({"status": "captioned", "captions": {}}, 2, 2) is None


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (DEFAULT_CAPTION_MODEL, (DEFAULT_CAPTION_MODEL, DEFAULT_CAPTION_REVISION)),
        ("org/captioner@v1.2", ("org/captioner", "v1.2")),
        ("org/captioner", ("org/captioner", None)),
        ("/models/my@captioner", ("/models/my@captioner", None)),
        (TINY_CAPTIONER, (TINY_CAPTIONER, None)),
    ],
)
def test_the_caption_model_setting_names_a_model_and_its_revision(
    setting: str, expected: tuple[str, str | None]
) -> None:
    assert caption_model(setting) == expected


# --- whole jobs -----------------------------------------------------------------------------------------------


def captioning_job(env: dict[str, str], caption_model_setting: str) -> dict[str, Any]:
    members = [*dataset_members(3), ("photo1.txt", (USER_CAPTION + "\n").encode())]
    job = job_input(dataset=to_base64(make_zip(members)), trigger_word="sks", captioning="missing")
    settings = WorkerSettings.from_environ({**env, "FLUXBOOTH_CAPTION_MODEL": caption_model_setting})
    return asyncio.run(run_job(job, job_id="captioning", settings=settings))


def captions_report(result: dict[str, Any]) -> dict[str, Any]:
    return json.loads(artifact_path(result, "report/captions.json").read_text(encoding="utf-8"))


def test_a_job_that_captions_keeps_the_users_caption_and_captions_the_rest_with_the_trigger_first(
    fake_env: dict[str, str],
) -> None:
    result = captioning_job(fake_env, TINY_CAPTIONER)

    assert "error" not in result, result
    images = {entry["image"]: entry for entry in captions_report(result)["images"]}
    assert images["photo1.png"] == {"image": "photo1.png", "caption": USER_CAPTION, "source": "user"}
    for name in ("photo0.png", "photo2.png"):
        assert images[name]["source"] == "captioner"
        assert images[name]["caption"].startswith("sks dog")
    assert result["dataset"]["captioned"] == 2
    assert not any(warning.startswith("captioning:") for warning in result["warnings"])


def test_a_job_whose_captioner_cannot_load_trains_on_the_instance_prompt_and_says_why(
    fake_env: dict[str, str], tmp_path: Path
) -> None:
    missing = tmp_path / "no-captioner"

    result = captioning_job(fake_env, str(missing))

    assert "error" not in result, result
    (warning,) = [warning for warning in result["warnings"] if warning.startswith("captioning:")]
    assert warning.startswith(
        "captioning: 2 of 2 photos without a caption file train on the instance prompt: "
        f"the captioner {missing} could not be loaded"
    )
    sources = captions_report(result)["sources"]
    assert sources == {"user": 1, "captioner": 0, "instance_prompt": 2}
    assert result["dataset"]["captioned"] == 0
