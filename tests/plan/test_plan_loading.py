"""The loading phase's CPU quantisation: a quantised base built in host RAM (block-swapped, or no GPU) is quantised
by the CPU's threads, at bench/quantise_cpu.py's nanoseconds per weight per thread."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.plan import JobShape, Strategy
from fluxbooth.plan.timing import CPU_QUANTISE_NS_PER_WEIGHT_THREAD, phase_seconds, quantised_elements
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size

SWAPPED = Strategy("lora", True, 2, "none", "none", "bf16", block_swap=True)
WHOLE_ON_THE_GPU = Strategy("lora", True, 2, "none", "none", "bf16")
# Any adapter and step time: loading reads neither.
TRAINABLE = 18_726_912
STEP_SECONDS = 2.0


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


def machine(gpus: int = 1, cpu_count: int = 16) -> Hardware:
    return hypothetical_hardware(
        gpus=gpus,
        gpu_memory_bytes=24 * GIB,
        host_memory_bytes=128 * GIB,
        disk_bytes=200 * GIB,
        cpu_count=cpu_count,
        gpu_name="NVIDIA GeForce RTX 4090",
    )


def loading_seconds(strategy: Strategy, model: ModelSize, hardware: Hardware, precision: str) -> float:
    job = JobShape(training_type="lora", num_instance_images=4)
    stored = replace(strategy, base_precision=precision)
    return phase_seconds(stored, model, job, hardware, TRAINABLE, STEP_SECONDS)["loading"]


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_a_swapped_quantised_base_loads_longer_by_its_weights_times_the_cost_over_the_threads(
    flux_dev: ModelSize, precision: str
) -> None:
    hardware = machine(cpu_count=16)

    extra = loading_seconds(SWAPPED, flux_dev, hardware, precision) - loading_seconds(
        SWAPPED, flux_dev, hardware, "bf16"
    )

    expected = quantised_elements(flux_dev) * CPU_QUANTISE_NS_PER_WEIGHT_THREAD[precision] * 1e-9 / 16
    assert extra == pytest.approx(expected, rel=1e-9)


def test_each_process_quantises_its_own_copy_on_its_share_of_the_cores(flux_dev: ModelSize) -> None:
    one = loading_seconds(SWAPPED, flux_dev, machine(gpus=1, cpu_count=16), "fp8")
    two = loading_seconds(SWAPPED, flux_dev, machine(gpus=2, cpu_count=16), "fp8")
    bf16 = loading_seconds(SWAPPED, flux_dev, machine(gpus=1, cpu_count=16), "bf16")

    assert two - bf16 == pytest.approx(2 * (one - bf16), rel=1e-9)


def test_a_base_quantised_on_the_gpu_adds_nothing_to_loading(flux_dev: ModelSize) -> None:
    hardware = machine()

    assert loading_seconds(WHOLE_ON_THE_GPU, flux_dev, hardware, "nf4") == loading_seconds(
        WHOLE_ON_THE_GPU, flux_dev, hardware, "bf16"
    )


def test_without_a_gpu_the_cpu_quantises_the_base(flux_dev: ModelSize) -> None:
    hardware = machine(gpus=0, cpu_count=2)

    extra = loading_seconds(WHOLE_ON_THE_GPU, flux_dev, hardware, "nf4") - loading_seconds(
        WHOLE_ON_THE_GPU, flux_dev, hardware, "bf16"
    )

    assert extra == pytest.approx(quantised_elements(flux_dev) * CPU_QUANTISE_NS_PER_WEIGHT_THREAD["nf4"] * 1e-9 / 2)
