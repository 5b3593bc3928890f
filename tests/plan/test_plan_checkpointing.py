"""Activation checkpointing chosen by memory: a request that leaves `gradient_checkpointing` unset gets the fastest
granularity that fits (none, every k-th block of each stack, every block), `true` and `false` force every block
and none, and the plan carries the choice to the trainer."""

from __future__ import annotations

from typing import Any

import pytest

from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.job.launch_files import memory_for
from fluxbooth.plan import Plan, Strategy, choose_plan
from fluxbooth.plan.memory import GPU_MARGIN
from fluxbooth.plan.runpod_gpus import runpod_gpu, worker_flags
from fluxbooth.plan.timing import step_terms
from fluxbooth.plan.types import JobShape
from fluxbooth.request.model import parse_request
from fluxbooth.sizing import FLUX_DEV_NAME, model_size
from tests.support.specs import job_spec

MODEL = model_size(FLUX_DEV_NAME)


def runpod_worker(name: str, gpus: int = 1) -> Hardware:
    """The machine a RunPod serverless worker on `name` gets (plan --runpod-gpu)."""
    flags = worker_flags(runpod_gpu(name))  # type: ignore[arg-type]
    return hypothetical_hardware(
        gpus=gpus,
        gpu_memory_bytes=flags["gpu_memory"],
        host_memory_bytes=flags["host_memory"] * gpus,
        disk_bytes=flags["disk"],
        cpu_count=flags["cpus"],
        gpu_name=flags["gpu_name"],
    )


def default_lora(hardware: Hardware, **fields: Any) -> Plan:
    request = {"model_name": "sks", "dataset_url": "https://example.com/d.zip", "instance_prompt": "a photo of sks"}
    return choose_plan(job_spec(parse_request({**request, **fields})), hardware, MODEL)


def test_a_default_lora_on_an_h100_checkpoints_less_and_is_at_least_10_percent_faster_per_step_than_forced() -> None:
    h100 = runpod_worker("H100 SXM")
    chosen = default_lora(h100)
    forced = default_lora(h100, gradient_checkpointing=True)

    assert (chosen.training_type, forced.checkpoint_every) == ("lora", 1)
    assert chosen.checkpoint_every != 1
    assert chosen.predicted_seconds_per_step is not None and forced.predicted_seconds_per_step is not None
    assert chosen.predicted_seconds_per_step <= 0.9 * forced.predicted_seconds_per_step
    assert chosen.predicted_gpu_bytes * (1 + GPU_MARGIN) <= h100.gpu_memory_bytes


@pytest.mark.parametrize(("card", "gpus"), [("RTX 4090", 1), ("RTX 3090", 1), ("L4", 1), ("RTX A5000", 2)])
def test_the_24_gib_defaults_still_fit_checkpointing_every_block(card: str, gpus: int) -> None:
    plan = default_lora(runpod_worker(card, gpus))

    assert (plan.training_type, plan.checkpoint_every, plan.gradient_checkpointing) == ("lora", 1, True)


def test_gradient_checkpointing_false_checkpoints_no_block_even_where_every_block_would_fit() -> None:
    plan = default_lora(runpod_worker("L40S"), gradient_checkpointing=False, resolution=512)

    assert (plan.checkpoint_every, plan.gradient_checkpointing) == (0, False)
    assert memory_for(plan).checkpoint_every == 0


def test_the_trainer_is_told_the_planners_granularity() -> None:
    plan = default_lora(runpod_worker("H100 SXM"))

    assert memory_for(plan).checkpoint_every == plan.checkpoint_every
    assert plan.to_dict()["checkpoint_every"] == plan.checkpoint_every


def test_a_48_gib_card_checkpoints_only_as_much_as_it_must() -> None:
    # 512²: every block's saved activations fit beside the bf16 base; 1024²: only with every other block
    # checkpointed (the adapter-sized ZeRO-2 buckets leave room for the rest).
    assert default_lora(runpod_worker("L40S"), resolution=512).checkpoint_every == 0
    assert default_lora(runpod_worker("L40S")).checkpoint_every == 2


def test_the_recompute_is_priced_as_the_checkpointed_blocks_forward() -> None:
    h100 = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=80 * GIB, host_memory_bytes=256 * GIB, disk_bytes=500 * GIB,
        gpu_name="NVIDIA H100 80GB HBM3",
    )  # fmt: skip
    compute = {
        every: step_terms(
            Strategy("lora", True, 2, "none", "none", checkpoint_every=every), MODEL, JobShape(), h100, 10**7, 2
        )["compute"]  # fmt: skip
        for every in (0, 2, 1)
    }

    assert compute[0] < compute[2] < compute[1]
    # LoRA: forward plus a backward of about one forward; every block recomputed adds about one more.
    assert compute[1] / compute[0] == pytest.approx(1.5, rel=0.02)
    assert (compute[2] - compute[0]) / (compute[1] - compute[0]) == pytest.approx(0.5, rel=0.05)


def test_a_strategy_that_checkpoints_less_than_every_block_says_so() -> None:
    lora = Strategy("lora", True, 2, "none", "none")

    assert Strategy("lora", True, 2, "none", "none", checkpoint_every=2).describe() == (
        f"{lora.describe()}, every 2nd block checkpointed"
    )
    assert Strategy("lora", True, 2, "none", "none", checkpoint_every=0).describe() == (
        f"{lora.describe()}, no activation checkpointing"
    )
