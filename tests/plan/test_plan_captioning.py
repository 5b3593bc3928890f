"""The captioning phase (`captioning: "missing"`): the captioner's own process before the trainer, priced by its
weights' bytes, for every photo the plan sizes for; nothing when the request does not caption."""

from __future__ import annotations

import pytest

from fluxbooth.contract.captioning import DEFAULT_CAPTION_MODEL, DEFAULT_CAPTION_MODEL_BYTES, TINY_CAPTIONER_BYTES
from fluxbooth.contract.captioning import captioner_bytes as bytes_of
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.plan import JobShape, Strategy
from fluxbooth.plan.memory import CUDA_CONTEXT_GPU_BYTES, estimate_memory
from fluxbooth.plan.timing import (
    CAPTIONING_SECONDS_PER_IMAGE,
    CAPTIONING_START_SECONDS,
    DISK_READ_BYTES_PER_SECOND,
    phase_seconds,
)
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size

LORA = Strategy("lora", True, 2, "none", "none", "bf16")
TRAINABLE = 18_726_912
STEP_SECONDS = 2.0
PHOTOS = 20


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


def l40s() -> Hardware:
    return hypothetical_hardware(
        gpus=1,
        gpu_memory_bytes=48 * GIB,
        host_memory_bytes=94 * GIB,
        disk_bytes=200 * GIB,
        cpu_count=8,
        gpu_name="NVIDIA L40S",
    )


def captioning_job(captioner: int) -> JobShape:
    return JobShape(training_type="lora", num_instance_images=PHOTOS, captioner_bytes=captioner)


def test_the_default_captioner_is_priced_by_its_start_its_read_and_every_photo(flux_dev: ModelSize) -> None:
    seconds = phase_seconds(LORA, flux_dev, captioning_job(DEFAULT_CAPTION_MODEL_BYTES), l40s(), TRAINABLE, 2.0)

    expected = (
        CAPTIONING_START_SECONDS
        + DEFAULT_CAPTION_MODEL_BYTES / DISK_READ_BYTES_PER_SECOND
        + PHOTOS * CAPTIONING_SECONDS_PER_IMAGE["cuda"]
    )
    assert seconds["captioning"] == pytest.approx(expected)


def test_a_job_that_does_not_caption_has_no_captioning_time(flux_dev: ModelSize) -> None:
    seconds = phase_seconds(LORA, flux_dev, captioning_job(0), l40s(), TRAINABLE, STEP_SECONDS)

    assert seconds["captioning"] == 0.0


def test_the_tiny_captioner_costs_its_start_and_almost_nothing_per_photo(flux_dev: ModelSize) -> None:
    seconds = phase_seconds(LORA, flux_dev, captioning_job(TINY_CAPTIONER_BYTES), l40s(), TRAINABLE, STEP_SECONDS)

    assert CAPTIONING_START_SECONDS < seconds["captioning"] < CAPTIONING_START_SECONDS + 1


def test_the_captioner_holds_its_weights_a_context_and_a_batch_on_the_gpu_before_the_base_loads(
    flux_dev: ModelSize,
) -> None:
    estimate = estimate_memory(LORA, flux_dev, captioning_job(DEFAULT_CAPTION_MODEL_BYTES), l40s(), "bf16")

    assert estimate.phase_gpu_bytes["captioning"] == CUDA_CONTEXT_GPU_BYTES + DEFAULT_CAPTION_MODEL_BYTES + GIB // 2
    # Its own process before the trainer's: none of the trainer's fixed host costs.
    assert estimate.phase_host_bytes["captioning"] == GIB + DEFAULT_CAPTION_MODEL_BYTES


def test_a_job_that_does_not_caption_holds_no_memory_for_it(flux_dev: ModelSize) -> None:
    estimate = estimate_memory(LORA, flux_dev, captioning_job(0), l40s(), "bf16")

    assert (estimate.phase_gpu_bytes["captioning"], estimate.phase_host_bytes["captioning"]) == (0, 0)


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        (DEFAULT_CAPTION_MODEL, DEFAULT_CAPTION_MODEL_BYTES),
        ("fluxbooth/tiny-captioner", TINY_CAPTIONER_BYTES),
        ("someone/their-captioner@abc123", DEFAULT_CAPTION_MODEL_BYTES),
    ],
)
def test_a_captioner_is_priced_by_its_weights_bytes(setting: str, expected: int) -> None:
    assert bytes_of(setting) == expected
