"""The training report and the dataset check through a whole job: a LoRA on the tiny model with two validation
prompts rendered by the base model (step 0, as likeness scoring does by default) and every 2 of 5 steps, trained by the real trainer under `accelerate launch` + DeepSpeed, on a
dataset with a duplicated photo (also re-encoded) and a blurred one. One run, read by every test here."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.job.run import run_job
from fluxbooth.report.sheets import dataset_size, samples_size
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from tests.conftest import worker_environment
from tests.support.factories import make_zip, to_base64
from tests.support.photos import BLURRED, DUPLICATED, flawed_dataset_members, png_size
from tests.support.result_artifacts import artifact_path

pytestmark = pytest.mark.slow

PROMPTS = ["a photo of sks dog", "a sks dog in the snow"]
STEPS = 5
FLAWED = {*DUPLICATED, BLURRED}
REPORT_PNGS = ("report/loss.png", "report/samples.png", "report/dataset.png")
MAX_PNG_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path) -> dict[str, Any]:
    env = worker_environment(tmp_path_factory.mktemp("report-job"), model_cache_dir, torch_extensions_dir)
    job_input = {
        "model_name": "sks-dog",
        "base_model": TINY_MODEL_NAME,
        "training_type": "lora",
        "lora_rank": 4,
        "dataset": to_base64(make_zip(flawed_dataset_members())),
        "instance_prompt": "a photo of sks dog",
        "steps": STEPS,
        "resolution": 64,
        "seed": 7,
        "validation_prompts": PROMPTS,
        "validation_steps": 2,
    }
    progress: list[dict[str, Any]] = []
    result = asyncio.run(
        run_job(job_input, job_id="report", settings=WorkerSettings.from_environ(env), progress=progress.append)
    )
    assert "error" not in result, result
    return {"result": result, "progress": progress}


def test_the_report_is_uploaded_with_the_weights(job: dict[str, Any]) -> None:
    names = {artifact["name"] for artifact in job["result"]["artifacts"]}
    assert {*REPORT_PNGS, "report/history.json"} <= names
    assert any(name.startswith("report/tensorboard/events.out.tfevents.") for name in names)
    assert any(name.endswith(".safetensors") for name in names)


def test_the_report_pngs_are_valid_and_small(job: dict[str, Any]) -> None:
    for name in REPORT_PNGS:
        path = artifact_path(job["result"], name)
        assert png_size(path) > (0, 0)
        assert path.stat().st_size < MAX_PNG_BYTES


def test_samples_png_has_a_row_for_the_base_model_steps_2_and_4_and_the_final_one(job: dict[str, Any]) -> None:
    width, height, _ = samples_size(rows=4, columns=len(PROMPTS))
    assert png_size(artifact_path(job["result"], "report/samples.png")) == (width, height)


def test_dataset_png_shows_every_training_image(job: dict[str, Any]) -> None:
    width, height, _, _ = dataset_size(len(flawed_dataset_members()))
    assert png_size(artifact_path(job["result"], "report/dataset.png")) == (width, height)


def test_history_json_holds_every_steps_loss_and_learning_rate(job: dict[str, Any]) -> None:
    history = json.loads(artifact_path(job["result"], "report/history.json").read_text())
    assert [entry["step"] for entry in history["steps"]] == list(range(1, STEPS + 1))
    assert all(math.isfinite(entry["loss"]) and entry["lr"] == pytest.approx(1e-4) for entry in history["steps"])
    assert history["steps"][-1]["loss"] == pytest.approx(job["result"]["metrics"]["final_loss"])
    assert (history["validation_steps"], history["validation_prompts"]) == ([0, 2, 4, STEPS], PROMPTS)


def test_the_event_file_reads_back_in_tensorboard_with_every_step_and_render(job: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (name,) = [a["name"] for a in job["result"]["artifacts"] if a["name"].startswith("report/tensorboard/")]
    accumulator = EventAccumulator(str(artifact_path(job["result"], name)), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [event.step for event in accumulator.Images("validation/prompt_00")] == [0, 2, 4]
    assert [event.step for event in accumulator.Images("validation_final/prompt_01")] == [STEPS]


def test_the_warnings_name_exactly_the_duplicated_and_the_blurred_files(job: dict[str, Any]) -> None:
    uploaded = {name for name, _ in flawed_dataset_members()}
    text = "\n".join(job["result"]["warnings"])
    assert {name for name in uploaded if name in text} == FLAWED
    findings = job["result"]["dataset"]["checks"]["findings"]
    assert {name for finding in findings for name in finding["files"]} == FLAWED


def test_checks_and_report_are_stages_of_their_own_and_timed(job: dict[str, Any]) -> None:
    stages = [update["stage"] for update in job["progress"]]
    order = [
        stage
        for index, stage in enumerate(stages)
        if stage in ("dataset", "checks", "train", "report", "upload") and stage not in stages[:index]
    ]
    assert order == ["dataset", "checks", "train", "report", "upload"]
    seconds = job["result"]["metrics"]["seconds"]
    assert seconds["checks"] >= 0 and seconds["report"] > 0
