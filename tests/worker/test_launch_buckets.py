"""ZeRO-1/2's reduce and allgather buckets in ds_config.json, sized for what is trained: a LoRA's the size of its
adapter (rounded up to 2^20 elements), a full fine-tune's the whole-model constants; the planner counts the same."""

from __future__ import annotations

from typing import Any

import pytest

from fluxbooth.contract import deepspeed_numbers as ds
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.job.launch_files import deepspeed_config
from fluxbooth.plan import JobShape, Strategy, plan_for_strategy
from fluxbooth.plan.memory import estimate_memory
from fluxbooth.plan.types import Plan
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size
from tests.support.guide_job import GUIDE_DEFAULT_PLAN, GUIDE_TRAINER

LORA_ZERO2 = Strategy("lora", True, 2, "none", "none")
FULL_ZERO2 = Strategy("full", True, 2, "cpu", "none")
MIB_ELEMENTS = 2**20


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


@pytest.fixture(scope="module")
def two_h100s() -> Hardware:
    return hypothetical_hardware(
        gpus=2,
        gpu_memory_bytes=80 * GIB,
        host_memory_bytes=512 * GIB,
        disk_bytes=500 * GIB,
        cpu_count=32,
        gpu_name="NVIDIA H100 80GB HBM3",
    )


def job(training_type: str) -> JobShape:
    return JobShape(training_type=training_type, num_instance_images=4)


def zero_section(plan: Plan) -> dict[str, Any]:
    return deepspeed_config(plan, GUIDE_TRAINER)["zero_optimization"]


def test_a_loras_buckets_are_its_adapter_rounded_up_to_whole_mebi_elements(
    flux_dev: ModelSize, two_h100s: Hardware
) -> None:
    plan = plan_for_strategy(LORA_ZERO2, job("lora"), two_h100s, flux_dev)
    assert plan.trainable_params is not None

    zero = zero_section(plan)

    adapter = -(-plan.trainable_params // MIB_ELEMENTS) * MIB_ELEMENTS
    assert adapter < ds.ZERO2_REDUCE_BUCKET_ELEMENTS
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (adapter, adapter)


def test_a_full_fine_tune_keeps_the_whole_model_buckets(flux_dev: ModelSize, two_h100s: Hardware) -> None:
    zero = zero_section(plan_for_strategy(FULL_ZERO2, job("full"), two_h100s, flux_dev))

    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (
        ds.ZERO2_REDUCE_BUCKET_ELEMENTS,
        ds.ZERO2_ALLGATHER_BUCKET_ELEMENTS,
    )


def test_a_hand_built_plan_without_a_trainable_count_keeps_the_constants() -> None:
    zero = zero_section(GUIDE_DEFAULT_PLAN)

    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (
        ds.ZERO2_REDUCE_BUCKET_ELEMENTS,
        ds.ZERO2_ALLGATHER_BUCKET_ELEMENTS,
    )


@pytest.mark.parametrize("strategy", [LORA_ZERO2, FULL_ZERO2], ids=["lora", "full"])
def test_the_planner_counts_the_buckets_the_config_asks_for(
    flux_dev: ModelSize, two_h100s: Hardware, strategy: Strategy
) -> None:
    shape = job(strategy.training_type)
    zero = zero_section(plan_for_strategy(strategy, shape, two_h100s, flux_dev))

    breakdown = estimate_memory(strategy, flux_dev, shape, two_h100s, "bf16").breakdown

    # bf16 (2 bytes); the reduce bucket twice, overlap_comm double-buffering it on CUDA.
    assert (breakdown["gpu.gradient_buckets"], breakdown["gpu.allgather_bucket"]) == (
        zero["reduce_bucket_size"] * 2 * 2,
        zero["allgather_bucket_size"] * 2,
    )
