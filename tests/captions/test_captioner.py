"""The captioning process (`python -m fluxbooth.captions`): what it writes and how it exits, run as the job runs it,
in a process of its own, on photos made here, with the tiny captioner. Its weights are random: what its captions
say after the trigger word and class noun is noise, and not asserted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.captions.captioner import caption_batches
from fluxbooth.captions.prompt import OBJECT_PROMPT, PERSON_PROMPT, PET_PROMPT, caption_prompt
from fluxbooth.captions.source import MODEL_FILE_PATTERNS, CaptionerUnavailable
from fluxbooth.captions.text import finish_caption
from fluxbooth.contract.captioning import TINY_CAPTIONER, CaptioningInput
from tests.conftest import load_builder_module
from tests.support.photos import textured_photo

PHOTOS = {"front.png": (64, 48), "side.png": (48, 64), "wide.png": (300, 200)}
TRIGGER, CLASS_NOUN = "sks", "person"
# A value of this process's environment that the captioner must never print.
UNPRINTED = "unprinted-3f9c1d"
# A commit of a hub repo that is nowhere but in the fake RunPod cache below.
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_REPO = "fluxbooth-tests/tiny-captioner"
RUN_SECONDS = 300


@dataclass(frozen=True)
class Run:
    returncode: int
    output: dict[str, Any]
    stderr: str


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Photos, a captioner cache and empty model places, shared by the module's runs (the tiny captioner is built
    once, by the first run)."""
    root = tmp_path_factory.mktemp("captioning")
    photos = root / "photos"
    photos.mkdir()
    for seed, (name, size) in enumerate(PHOTOS.items()):
        textured_photo(seed, size).save(photos / name)
    for place in ("cache", "hf", "runpod", "baked"):
        (root / place).mkdir()
    return root


def base_input(workspace: Path) -> CaptioningInput:
    return CaptioningInput(
        photos_dir=str(workspace / "photos"),
        images=tuple(PHOTOS),
        model=TINY_CAPTIONER,
        revision=None,
        trigger_word=TRIGGER,
        class_noun=CLASS_NOUN,
        subject_type="auto",
        device="cpu",
        batch_size=2,
        max_new_tokens=8,
    )


def run_captioning(workspace: Path, request: CaptioningInput, name: str) -> Run:
    input_path, output_path = workspace / f"{name}-input.json", workspace / f"{name}-output.json"
    request.write(input_path)
    env = {
        **os.environ,
        "FLUXBOOTH_CACHE_DIR": str(workspace / "cache"),
        "HF_HUB_CACHE": str(workspace / "hf"),
        "FLUXBOOTH_RUNPOD_MODEL_CACHE": str(workspace / "runpod"),
        "FLUXBOOTH_BAKED_MODELS_DIR": str(workspace / "baked"),
        "HF_HUB_OFFLINE": "1",
        "FLUXBOOTH_TEST_UNPRINTED": UNPRINTED,
        # One thread: the tiny model gains nothing from more, and the test run shares the machine's cores.
        "OMP_NUM_THREADS": "1",
    }
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.captions", "--input", str(input_path), "--output", str(output_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    return Run(completed.returncode, json.loads(output_path.read_text()), completed.stderr)


@pytest.fixture(scope="module")
def captioned(workspace: Path) -> Run:
    return run_captioning(workspace, base_input(workspace), "tiny")


@pytest.fixture(scope="module")
def runpod_snapshot(workspace: Path, captioned: Run) -> Path:
    """The tiny captioner (built by the first run) as RunPod caches a model: snapshots/<commit>, no refs."""
    snapshot = workspace / "runpod" / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / COMMIT
    shutil.copytree(workspace / "cache" / "captioner" / "tiny-captioner-seed0", snapshot)
    return snapshot


def test_the_tiny_captioner_captions_every_listed_photo_and_exits_0(captioned: Run) -> None:
    assert captioned.returncode == 0
    assert captioned.output["status"] == "captioned"
    assert sorted(captioned.output["captions"]) == sorted(PHOTOS)


def test_every_caption_starts_with_the_trigger_word_and_the_class_noun(captioned: Run) -> None:
    starts = {
        name: caption.startswith(f"{TRIGGER} {CLASS_NOUN}") for name, caption in captioned.output["captions"].items()
    }
    assert starts == {name: True for name in PHOTOS}


def test_the_output_names_the_model_the_device_and_the_time_taken(captioned: Run) -> None:
    assert captioned.output["model"] == {"name": TINY_CAPTIONER, "revision": None}
    assert captioned.output["device"] == "cpu"
    assert captioned.output["seconds"] > 0


def test_the_tiny_captioner_is_built_in_the_captioner_folder_of_the_cache(workspace: Path, captioned: Run) -> None:
    assert (workspace / "cache" / "captioner" / "tiny-captioner-seed0" / "model.safetensors").is_file()


def test_the_log_says_how_far_each_batch_got_and_prints_no_environment_value(captioned: Run) -> None:
    progress = [line.split(" in ")[0] for line in captioned.stderr.splitlines() if line.startswith("captioned ")]
    assert progress == ["captioned 2/3 photos", "captioned 3/3 photos"]
    assert UNPRINTED not in captioned.stderr


def test_a_model_folder_that_does_not_exist_is_unavailable_naming_it(workspace: Path) -> None:
    missing = str(workspace / "no-such-captioner")
    run = run_captioning(workspace, replace(base_input(workspace), model=missing), "missing")
    assert run.returncode == 0
    assert run.output == {
        "status": "unavailable",
        "reason": f"the captioner {missing} could not be loaded: there is no such folder",
        "captions": {},
    }


def test_a_deadline_already_past_is_unavailable_with_no_captions(workspace: Path) -> None:
    request = replace(base_input(workspace), stop_at_unix_seconds=time.time() - 1)
    run = run_captioning(workspace, request, "late")
    assert run.returncode == 0
    assert run.output == {
        "status": "unavailable",
        "reason": "the job deadline left no time to caption the rest",
        "captions": {},
    }


def test_a_hub_model_in_runpods_cache_is_found_offline_at_its_pinned_revision(
    workspace: Path, runpod_snapshot: Path
) -> None:
    request = replace(base_input(workspace), model=HUB_REPO, revision=COMMIT, images=("front.png",))
    run = run_captioning(workspace, request, "runpod")
    assert run.returncode == 0
    assert (run.output["status"], run.output["model"]) == ("captioned", {"name": HUB_REPO, "revision": COMMIT})


def test_a_hub_model_found_nowhere_with_downloads_off_is_unavailable_naming_every_place(workspace: Path) -> None:
    run = run_captioning(workspace, replace(base_input(workspace), model="fluxbooth-tests/absent"), "absent")
    caches = ", ".join(str(workspace / place) for place in ("hf", "runpod", "baked"))
    plain = workspace / "baked" / "fluxbooth-tests" / "absent"
    assert run.returncode == 0
    assert run.output == {
        "status": "unavailable",
        "reason": "the captioner fluxbooth-tests/absent could not be loaded: revision main is not on this worker "
        f"(looked in {caches} and {plain}) and downloads are off (HF_HUB_OFFLINE=1)",
        "captions": {},
    }


def test_an_input_that_cannot_be_read_is_a_crash_whose_output_still_says_so(workspace: Path) -> None:
    input_path, output_path = workspace / "broken-input.json", workspace / "broken-output.json"
    input_path.write_text("{not json")
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.captions", "--input", str(input_path), "--output", str(output_path)],
        capture_output=True,
        text=True,
        timeout=RUN_SECONDS,
    )
    output = json.loads(output_path.read_text())
    assert completed.returncode == 1
    assert (output["status"], output["captions"]) == ("unavailable", {})
    assert output["reason"].startswith("the captioner failed (JSONDecodeError: ")


def test_each_raw_text_is_finished_with_the_requests_trigger_class_noun_and_subject_type(workspace: Path) -> None:
    request = replace(base_input(workspace), subject_type="pet", class_noun="dog")
    finished: dict[str, str] = {}
    logged: list[str] = []
    assert caption_batches(request, lambda images: [f"raw {image.size}" for image in images], finished, logged.append)
    assert finished == {
        name: finish_caption(f"raw {size}", trigger_word=TRIGGER, class_noun="dog", subject_type="pet")
        for name, size in PHOTOS.items()
    }


def test_a_batch_is_not_started_when_less_time_is_left_than_the_last_batch_took(workspace: Path) -> None:
    request = replace(base_input(workspace), stop_at_unix_seconds=time.time() + 1.0)
    assert request.stop_at_unix_seconds is not None
    stop_at = request.stop_at_unix_seconds

    def slow_describe(images: list[Any]) -> list[str]:
        # The first batch ends a quarter second before the deadline, having taken about three quarters.
        time.sleep(max(stop_at - 0.25 - time.time(), 0.0))
        return ["raw"] * len(images)

    finished: dict[str, str] = {}
    logged: list[str] = []
    assert caption_batches(request, slow_describe, finished, logged.append) is False
    assert list(finished) == list(request.images[:2])


@pytest.fixture(scope="module")
def batch_inputs(workspace: Path, captioned: Run) -> dict[str, Any]:
    """The tiny captioner's (built by the first run) inputs for a landscape photo and a narrower, taller one."""
    from fluxbooth.captions.model import load_captioner, model_inputs

    folder = workspace / "cache" / "captioner" / "tiny-captioner-seed0"
    captioner = load_captioner(TINY_CAPTIONER, folder, "cpu")
    return model_inputs(captioner, [textured_photo(0, (64, 48)), textured_photo(1, (32, 256))], PERSON_PROMPT)


def test_each_photo_gets_one_image_token_per_merged_2x2_patch(batch_inputs: dict[str, Any]) -> None:
    patches = [time * height * width for time, height, width in batch_inputs["image_grid_thw"].tolist()]
    assert batch_inputs["mm_token_type_ids"].sum(dim=1).tolist() == [count // 4 for count in patches]


def test_a_batch_is_padded_on_the_left(batch_inputs: dict[str, Any]) -> None:
    mask = batch_inputs["attention_mask"]
    shorter = int(mask.sum(dim=1).argmin())
    padding = int(mask.shape[1] - mask[shorter].sum())
    assert padding > 0
    assert mask[shorter, :padding].tolist() == [0] * padding
    assert mask[:, -1].tolist() == [1, 1]


def test_a_hub_captioner_is_fetched_as_the_image_bakes_the_default_one() -> None:
    # A worker that downloads the captioner and an image that baked it hold the same files, so either finds the
    # other's snapshot complete.
    _repo, _revision, baked_patterns = load_builder_module("fetch_model").CAPTION_MODEL
    assert sorted(MODEL_FILE_PATTERNS) == sorted(baked_patterns)


def test_auto_runs_on_cuda_when_torch_sees_a_device_else_on_the_cpu() -> None:
    import torch

    from fluxbooth.captions.model import pick_device

    assert pick_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cuda_asked_for_where_there_is_none_is_unavailable() -> None:
    import torch

    from fluxbooth.captions.model import pick_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(CaptionerUnavailable, match="^the captioner was asked to run on cuda, but torch sees no CUDA"):
        pick_device("cuda")


def test_auto_photos_are_asked_the_persons_prompt() -> None:
    assert caption_prompt("auto") == PERSON_PROMPT


def test_the_persons_prompt_forbids_every_identity_word() -> None:
    forbidden = PERSON_PROMPT.split("Do not mention ", 1)[1].split(".", 1)[0]
    assert forbidden == "their face shape, hair, eye colour, skin colour, age, ethnicity or body shape"


@pytest.mark.parametrize("prompt", [PERSON_PROMPT, PET_PROMPT, OBJECT_PROMPT])
def test_every_prompt_asks_for_one_or_two_sentences_on_framing_setting_lighting_and_shot(prompt: str) -> None:
    asked = ("one or two plain sentences", "frames", "the setting", "the lighting", "camera angle or shot type")
    assert [part for part in asked if part not in prompt] == []


def test_a_pets_prompt_asks_for_its_colour_and_breed() -> None:
    assert caption_prompt("pet") == PET_PROMPT
    assert "its colour and breed" in PET_PROMPT
    assert "Do not mention" not in PET_PROMPT
