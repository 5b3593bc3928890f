"""trainer_failures.kept_after_export: what a trainer that failed after its export leaves the caller."""

from __future__ import annotations

from fluxbooth.contract.events import EXPORTED_STATUS, DoneEvent, StageEvent, StepEvent, TrainerEvent, WarningEvent
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.supervisor import ProcessOutcome
from fluxbooth.job.trainer_failures import kept_after_export

LORA = [{"name": "lora", "path": "lora/pytorch_lora_weights.safetensors", "kind": "lora_diffusers"}]
LAST_STEP = StepEvent(step=4, total=4, loss=0.5, lr=1e-4, seconds_per_step=1.0)
OOM = FluxboothError(ErrorCode.CUDA_OOM, "the GPU ran out of memory after step 4/4 (plan: ZeRO-2)\nmore lines")


def outcome(*events: TrainerEvent, last_stage: str | None = None) -> ProcessOutcome:
    return ProcessOutcome(
        returncode=1, log_tail=[], last_step=LAST_STEP, events=[LAST_STEP, *events], last_stage=last_stage
    )


def exported() -> StageEvent:
    return StageEvent("export", {"status": EXPORTED_STATUS, "artifacts": LORA})


def test_a_failure_in_the_final_renders_keeps_the_exported_files_as_a_finished_run() -> None:
    kept = kept_after_export(outcome(exported(), StageEvent("validate"), last_stage="validate"), OOM)

    assert kept is not None
    assert kept.done == DoneEvent(
        metrics={"steps": 4, "final_loss": 0.5, "failed_after_export": "cuda_oom"}, artifacts=LORA
    )


def test_a_failure_in_the_final_renders_is_a_warning_naming_the_stage_and_the_error() -> None:
    kept = kept_after_export(outcome(exported(), StageEvent("validate"), last_stage="validate"), OOM)

    assert kept is not None
    assert kept.events[-1] == WarningEvent(
        "the trainer failed after exporting the weights, in its validate stage (cuda_oom: the GPU ran out of memory "
        "after step 4/4 (plan: ZeRO-2)); the exported weights are kept and uploaded, without the final validation "
        "renders"
    )


def test_a_failure_as_the_export_ends_names_no_stage() -> None:
    kept = kept_after_export(outcome(exported(), last_stage="export"), OOM)

    assert kept is not None and isinstance(kept.events[-1], WarningEvent)
    assert kept.events[-1].message.startswith("the trainer failed after exporting the weights (cuda_oom: ")


def test_a_failure_before_the_export_finished_keeps_nothing() -> None:
    started = StageEvent("export", {"formats": ["diffusers"]})

    assert kept_after_export(outcome(started, last_stage="export"), OOM) is None


def test_a_cancelled_trainer_keeps_nothing_even_after_its_export() -> None:
    cancelled = FluxboothError(ErrorCode.CANCELLED, "the trainer was stopped from outside the worker")

    assert kept_after_export(outcome(exported(), last_stage="validate"), cancelled) is None
