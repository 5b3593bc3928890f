"""The deadline in the plan (issue 27): a run predicted to end after its deadline is refused before anything is
downloaded, with the steps and the timeout that would fit; one predicted to use more than half of it checkpoints
on its own; the base model's download and the artifacts' upload are phases, timed at the worker's stated rates."""

from __future__ import annotations

import math

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.plan import JobShape, Plan, choose_plan
from fluxbooth.plan.checks import AUTO_CHECKPOINTS_PER_RUN
from fluxbooth.plan.types import TIMED_PHASES
from fluxbooth.settings import (
    DEFAULT_DOWNLOAD_BYTES_PER_SECOND,
    DEFAULT_UPLOAD_BYTES_PER_SECOND,
    TransferRates,
    WorkerSettings,
)
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size

RTX_4090 = "NVIDIA GeForce RTX 4090"


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


def rtx_4090() -> Hardware:
    return hypothetical_hardware(
        gpus=1, gpu_memory_bytes=24 * GIB, host_memory_bytes=62 * GIB, disk_bytes=200 * GIB, gpu_name=RTX_4090
    )


def lora(**fields: object) -> JobShape:
    """FLUX.1-dev rank-16 LoRA at 1024², 1000 steps, four photos."""
    return JobShape(**{"training_type": "lora", "num_instance_images": 4, **fields})  # type: ignore[arg-type]


def unbounded(job: JobShape, model: ModelSize, **kwargs: object) -> Plan:
    """The plan with no deadline: its predicted total is what the deadline tests scale."""
    return choose_plan(job, rtx_4090(), model, deadline_seconds=None, **kwargs)  # type: ignore[arg-type]


def refusal(job: JobShape, model: ModelSize, deadline: float) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(job, rtx_4090(), model, deadline_seconds=deadline)
    return caught.value


def phase_seconds(plan: Plan) -> dict[str, float]:
    return {name: phase.seconds for name, phase in plan.phases}


# ---- refused beyond the deadline ---------------------------------------------------------------------


def test_a_job_predicted_at_1_2x_its_deadline_is_refused(flux_dev: ModelSize) -> None:
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    error = refusal(lora(), flux_dev, total / 1.2)

    assert error.code is ErrorCode.DOES_NOT_FIT
    assert error.message.startswith("steps: 1000 steps at ≈")
    assert error.details["estimated_seconds"] == round(total)
    assert error.details["deadline_seconds"] == round(total / 1.2)


def test_the_refusal_names_the_steps_and_the_timeout_that_would_fit(flux_dev: ModelSize) -> None:
    plan = unbounded(lora(), flux_dev)
    total, per_step = plan.predicted_total_seconds, plan.predicted_seconds_per_step
    assert total is not None and per_step is not None
    deadline = total / 1.2

    error = refusal(lora(), flux_dev, deadline)

    steps = error.details["steps_that_fit"]
    # Every other phase as planned, the steps fill what is left of the deadline.
    assert 0 < steps < 1000
    assert steps == pytest.approx((deadline - (total - 1000 * per_step)) / per_step, abs=2)
    timeout = error.details["timeout_that_fits"]
    assert timeout == math.ceil(total * 1.25 / 60) * 60
    assert f"about {steps} steps" in error.message
    assert f"timeout_seconds {timeout} (and an endpoint execution timeout above it)" in error.message


def test_a_job_just_over_its_deadline_is_refused_too(flux_dev: ModelSize) -> None:
    # No tolerance factor: a run the plan says ends after its deadline never starts.
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    assert refusal(lora(), flux_dev, total * 0.99).code is ErrorCode.DOES_NOT_FIT


def test_a_refusal_never_suggests_the_timeout_the_job_was_sent(flux_dev: ModelSize) -> None:
    # Replanned after a slow dataset download: less is left than the job's timeout_seconds, which would fit
    # the whole run; raising it to what it already is cannot help.
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None
    sent = math.ceil(total * 1.25 / 60) * 60

    error = refusal(lora(timeout_seconds=sent), flux_dev, total / 1.2)

    assert "timeout_seconds" not in error.message
    assert "about " in error.message


def test_a_job_within_its_deadline_is_planned(flux_dev: ModelSize) -> None:
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    plan = choose_plan(lora(), rtx_4090(), flux_dev, deadline_seconds=total * 1.01)

    assert plan.predicted_total_seconds == total


# ---- checkpointing without being asked ---------------------------------------------------------------


def test_a_job_predicted_at_0_6x_its_deadline_checkpoints_without_being_asked(flux_dev: ModelSize) -> None:
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    plan = choose_plan(lora(), rtx_4090(), flux_dev, deadline_seconds=total / 0.6)

    assert plan.checkpointing_steps == math.ceil(1000 / AUTO_CHECKPOINTS_PER_RUN) == 250
    said = [warning for warning in plan.warnings if warning.startswith("checkpointing_steps:")]
    assert len(said) == 1
    assert "more than half" in said[0] and "every 250 steps on its own" in said[0]
    assert '"resume_from": "latest"' in said[0]


def test_a_job_predicted_under_half_its_deadline_checkpoints_only_when_asked(flux_dev: ModelSize) -> None:
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    plan = choose_plan(lora(), rtx_4090(), flux_dev, deadline_seconds=total / 0.4)

    assert plan.checkpointing_steps is None
    assert not any(warning.startswith("checkpointing_steps:") for warning in plan.warnings)


def test_a_job_that_asked_for_checkpoints_keeps_its_own_interval(flux_dev: ModelSize) -> None:
    total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert total is not None

    plan = choose_plan(lora(checkpointing_steps=100), rtx_4090(), flux_dev, deadline_seconds=total / 0.6)

    assert plan.checkpointing_steps == 100
    assert not any(warning.startswith("checkpointing_steps:") for warning in plan.warnings)


# ---- the network phases -------------------------------------------------------------------------------


def test_every_phase_is_in_the_plan_the_download_first_and_the_upload_last(flux_dev: ModelSize) -> None:
    plan = unbounded(lora(), flux_dev)

    assert [name for name, _ in plan.phases] == list(TIMED_PHASES)
    assert TIMED_PHASES[0] == "download" and TIMED_PHASES[-1] == "upload"


def test_a_cached_base_model_has_nothing_to_download(flux_dev: ModelSize) -> None:
    assert phase_seconds(unbounded(lora(), flux_dev))["download"] == 0


def test_the_base_models_pending_download_is_timed_at_the_stated_rate(flux_dev: ModelSize) -> None:
    pending = 34 * 10**9
    cached = unbounded(lora(), flux_dev)

    cold = unbounded(lora(), flux_dev, download_bytes=pending)

    assert phase_seconds(cold)["download"] == round(pending / DEFAULT_DOWNLOAD_BYTES_PER_SECOND, 1)
    assert cold.predicted_total_seconds == pytest.approx(
        (cached.predicted_total_seconds or 0) + pending / DEFAULT_DOWNLOAD_BYTES_PER_SECOND, abs=0.2
    )


def test_a_slower_stated_download_rate_makes_a_longer_download(flux_dev: ModelSize) -> None:
    rates = TransferRates(download_bytes_per_second=25e6)

    plan = unbounded(lora(), flux_dev, download_bytes=10**9, transfer_rates=rates)

    assert phase_seconds(plan)["download"] == 40.0


def test_the_download_counts_against_the_deadline(flux_dev: ModelSize) -> None:
    cached_total = unbounded(lora(), flux_dev).predicted_total_seconds
    assert cached_total is not None
    deadline = cached_total + 100  # fits when cached; a 34 GB download at 100 MB/s takes 340 s more

    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(), rtx_4090(), flux_dev, deadline_seconds=deadline, download_bytes=34 * 10**9)

    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert caught.value.details["phase_seconds"]["download"] == 340


def test_the_upload_is_the_exported_adapter_at_the_stated_upload_rate(flux_dev: ModelSize) -> None:
    plan = unbounded(lora(), flux_dev)
    # A rank-16 LoRA exports its adapter in bf16: a few tens of MB.
    adapter_bytes = phase_seconds(plan)["upload"] * DEFAULT_UPLOAD_BYTES_PER_SECOND

    assert 10e6 < adapter_bytes < 200e6


def test_a_full_fine_tune_uploads_the_whole_transformer(flux_dev: ModelSize) -> None:
    full = choose_plan(
        JobShape(training_type="full", num_instance_images=4),
        hypothetical_hardware(
            gpus=1,
            gpu_memory_bytes=141 * GIB,
            host_memory_bytes=250 * GIB,
            disk_bytes=400 * GIB,
            gpu_name="NVIDIA H200",
        ),
        flux_dev,
        deadline_seconds=None,
    )

    assert phase_seconds(full)["upload"] == round(flux_dev.transformer_params * 2 / DEFAULT_UPLOAD_BYTES_PER_SECOND, 1)


def test_the_plan_says_how_long_a_run_stopped_by_its_deadline_needs_to_keep_its_work(flux_dev: ModelSize) -> None:
    plan = unbounded(lora(), flux_dev)
    phases = phase_seconds(plan)

    assert plan.predicted_stop_reserve_seconds is not None
    # The checkpoint's write and upload come on top of the export, the report and the upload.
    assert plan.predicted_stop_reserve_seconds > phases["export"] + phases["report"] + phases["upload"]


# ---- the worker's settings ------------------------------------------------------------------------------


def test_the_transfer_rates_are_read_from_the_environment() -> None:
    settings = WorkerSettings.from_environ(
        {"FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND": "250e6", "FLUXBOOTH_UPLOAD_BYTES_PER_SECOND": "20000000"}
    )

    assert settings.transfer_rates == TransferRates(download_bytes_per_second=250e6, upload_bytes_per_second=20e6)


def test_unset_transfer_rates_are_the_stated_defaults() -> None:
    assert WorkerSettings.from_environ({}).transfer_rates == TransferRates(
        download_bytes_per_second=DEFAULT_DOWNLOAD_BYTES_PER_SECOND,
        upload_bytes_per_second=DEFAULT_UPLOAD_BYTES_PER_SECOND,
    )


@pytest.mark.parametrize("raw", ["0", "-5", "fast"])
def test_a_transfer_rate_that_is_not_a_positive_number_is_refused(raw: str) -> None:
    with pytest.raises(ValueError, match=f"FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND={raw!r}"):
        WorkerSettings.from_environ({"FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND": raw})
