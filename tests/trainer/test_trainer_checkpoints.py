"""Checkpoints and resume.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from fluxbooth.contract.checkpoint_record import CHECKPOINT_RECORD_NAME, CheckpointRecord
from tests.support.resume_tolerance import close_after_resume
from tests.support.trainer_jobs import (
    TrainerRun,
    assert_succeeded,
    make_plan,
    new_job,
    read_json,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# Checkpoints and resume
# --------------------------------------------------------------------------------------------------
# A resumed run is compared with the uninterrupted one within a tolerance: tests/support/resume_tolerance.py
# says which and why.


def resume_pair(tiny_base: Path, root: Path, training_type: str, **overrides: Any) -> tuple[TrainerRun, TrainerRun]:
    plan = make_plan(training_type=training_type)
    settings = {"steps": 4, "checkpointing_steps": 2, "lr_scheduler": "cosine", "lr_warmup_steps": 1, **overrides}
    if training_type == "lora":
        settings["export_formats"] = ("diffusers",)
    uninterrupted = new_job(root / "uninterrupted", tiny_base, plan=plan, **settings).launch()
    assert_succeeded(uninterrupted)
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]
    resumed = new_job(root / "resumed", tiny_base, plan=plan, resume_from=checkpoint, **settings).launch()
    assert_succeeded(resumed)
    return uninterrupted, resumed


@pytest.fixture(scope="module")
def full_resume(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    return resume_pair(tiny_base, tmp_path_factory.mktemp("full-resume"), "full")


@pytest.fixture(scope="module")
def lora_resume(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    return resume_pair(tiny_base, tmp_path_factory.mktemp("lora-resume"), "lora")


@pytest.mark.parametrize("pair_name", ["full_resume", "lora_resume"])
def test_resumed_run_continues_after_the_checkpoint_step(pair_name: str, request: pytest.FixtureRequest) -> None:
    uninterrupted, resumed = request.getfixturevalue(pair_name)
    assert [event["step"] for event in resumed.of_kind("step")] == [3, 4]
    assert resumed.metrics["resumed_from_step"] == 2
    first_resumed, first_replayed = resumed.of_kind("step")[0], uninterrupted.of_kind("step")[2]
    assert (first_resumed["loss"], first_resumed["lr"]) == (first_replayed["loss"], first_replayed["lr"])


@pytest.mark.parametrize("pair_name", ["full_resume", "lora_resume"])
def test_resumed_run_ends_with_the_uninterrupted_weights_within_float_tolerance(
    pair_name: str, request: pytest.FixtureRequest
) -> None:
    uninterrupted, resumed = request.getfixturevalue(pair_name)
    kind = "diffusers_transformer" if pair_name == "full_resume" else "lora_diffusers"
    path_a, path_b = uninterrupted.artifact(kind), resumed.artifact(kind)
    if kind == "diffusers_transformer":
        path_a, path_b = path_a / "diffusion_pytorch_model.safetensors", path_b / "diffusion_pytorch_model.safetensors"
    a, b = load_file(path_a), load_file(path_b)
    assert a.keys() == b.keys()
    for name in a:
        assert close_after_resume(a[name], b[name], uninterrupted.config.optimisation.learning_rate), name
    assert resumed.metrics["final_loss"] == pytest.approx(uninterrupted.metrics["final_loss"], rel=1e-3)


def test_resume_with_a_torch_optimizer_under_deepspeed_continues_the_schedule_the_trainer_steps(
    tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, resumed = resume_pair(tiny_base, tmp_path, "lora", optimizer="sgd")

    assert resumed.metrics["optimizer"] == "SGD"
    assert [event["step"] for event in resumed.of_kind("step")] == [3, 4]
    assert [event["lr"] for event in resumed.of_kind("step")] == pytest.approx(
        [event["lr"] for event in uninterrupted.of_kind("step")][2:]
    )
    a, b = load_file(uninterrupted.artifact("lora_diffusers")), load_file(resumed.artifact("lora_diffusers"))
    assert all(close_after_resume(a[name], b[name], uninterrupted.config.optimisation.learning_rate) for name in a)


def test_lora_checkpoint_holds_only_the_adapter(lora_resume: tuple[TrainerRun, TrainerRun]) -> None:
    uninterrupted, _ = lora_resume
    (checkpoint,) = [Path(event["path"]) for event in uninterrupted.of_kind("checkpoint")]
    module_state = torch.load(checkpoint / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module_state and all(".lora_" in name for name in module_state)


def test_a_lora_checkpoint_records_its_base_model_family_and_lora_shape(
    lora_resume: tuple[TrainerRun, TrainerRun],
) -> None:
    uninterrupted, _ = lora_resume
    (checkpoint,) = [Path(event["path"]) for event in uninterrupted.of_kind("checkpoint")]
    config = uninterrupted.config
    assert CheckpointRecord.from_json((checkpoint / CHECKPOINT_RECORD_NAME).read_text()) == CheckpointRecord(
        base_model=config.export.base_model_name or config.base_model,
        family="flux1",
        training_type="lora",
        lora_rank=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_targets=config.lora.target_modules,
    )


def test_checkpoint_event_names_a_complete_folder(full_resume: tuple[TrainerRun, TrainerRun]) -> None:
    uninterrupted, _ = full_resume
    (event,) = uninterrupted.of_kind("checkpoint")
    folder = Path(event["path"])
    assert (event["step"], folder.name) == (2, "checkpoint-2")
    assert read_json(folder / "fluxbooth_state.json")["step"] == 2
    assert not list(folder.parent.glob(".*partial"))


def test_resume_latest_picks_the_newest_checkpoint_in_the_checkpoint_folder(
    full_resume: tuple[TrainerRun, TrainerRun], tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, _ = full_resume
    job = new_job(tmp_path / "job", tiny_base, steps=4, checkpointing_steps=2, lr_scheduler="cosine", lr_warmup_steps=1)
    shutil.copytree(uninterrupted.job_dir / "checkpoints", job.job_dir / "checkpoints")
    job.config = dataclasses.replace(
        job.config, checkpoints=dataclasses.replace(job.config.checkpoints, resume_from="latest")
    )

    run = job.launch()

    assert_succeeded(run)
    assert [event["step"] for event in run.of_kind("step")] == [3, 4]


def test_resume_with_a_different_training_type_is_refused(
    full_resume: tuple[TrainerRun, TrainerRun], tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, _ = full_resume
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]
    run = new_job(
        tmp_path / "job", tiny_base, plan=make_plan(training_type="lora"), steps=4, resume_from=checkpoint
    ).launch()

    assert run.returncode != 0
    (error,) = run.of_kind("error")
    assert error["code"] == "resume_failed"
    assert "training_type" in error["message"]
