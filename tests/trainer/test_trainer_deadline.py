"""The trainer's stop time (issue 27, item 3): past `stop_at_unix_seconds` it stops at the next step boundary,
checkpoints there, exports the weights trained so far and says so in its `done` metrics; the final renders are
skipped, so the time left goes to the upload. The real trainer on the tiny FLUX model under `accelerate launch`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.support.trainer_jobs import TrainerRun, assert_succeeded, make_plan, new_job

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stopped(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    # A stop time already past when training begins: the run stops after its first step.
    run = new_job(
        tmp_path_factory.mktemp("stopped"),
        tiny_base,
        plan=make_plan(training_type="lora"),
        steps=6,
        export_formats=("diffusers",),
        validation_prompts=("a photo of sks dog",),
        stop_at_unix_seconds=time.time(),
    ).launch()
    assert_succeeded(run)
    return run


def test_a_run_past_its_stop_time_stops_at_the_next_step_boundary(stopped: TrainerRun) -> None:
    assert [event["step"] for event in stopped.of_kind("step")] == [1]
    assert (stopped.metrics["stopped_for_deadline"], stopped.metrics["steps_done"]) == (True, 1)


def test_a_stopped_run_checkpoints_where_it_stopped(stopped: TrainerRun) -> None:
    (checkpoint,) = stopped.of_kind("checkpoint")
    assert checkpoint["step"] == 1
    assert Path(checkpoint["path"]).name == "checkpoint-1"


def test_a_stopped_run_exports_the_adapter_trained_so_far(stopped: TrainerRun) -> None:
    adapter = load_file(stopped.artifact("lora_diffusers"))
    assert any(".lora_A." in name for name in adapter) and any(".lora_B." in name for name in adapter)


def test_a_stopped_run_skips_the_final_renders(stopped: TrainerRun) -> None:
    assert not [artifact for artifact in stopped.done["artifacts"] if artifact["kind"].startswith("validation")]
