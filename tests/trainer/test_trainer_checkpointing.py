"""Activation checkpointing at the planner's granularities through the real trainer (`accelerate launch`, DeepSpeed
ZeRO-2 on the CPU accelerator, the tiny FLUX model: 2 double-stream and 2 single-stream blocks): recomputing
every block, every second one or none changes what is kept for the backward, never the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.trainer_jobs import TrainerRun, assert_succeeded, make_plan, new_job

pytestmark = pytest.mark.slow


def lora_run(root: Path, base: Path, checkpoint_every: int) -> TrainerRun:
    """Three steps of the same seeded LoRA job with every `checkpoint_every`-th block of each stack checkpointed."""
    job = new_job(
        root,
        base,
        plan=make_plan(training_type="lora", offload_optimizer="none"),
        steps=3,
        checkpoint_every=checkpoint_every,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def without_checkpointing(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    return lora_run(tmp_path_factory.mktemp("checkpoint-none"), tiny_base, 0)


@pytest.mark.parametrize(("checkpoint_every", "checkpointed_blocks"), [(1, 4), (2, 2)])
def test_the_same_seed_gives_the_same_losses_whichever_blocks_are_checkpointed(
    checkpoint_every: int,
    checkpointed_blocks: int,
    without_checkpointing: TrainerRun,
    tiny_base: Path,
    tmp_path: Path,
) -> None:
    run = lora_run(tmp_path, tiny_base, checkpoint_every)

    assert without_checkpointing.metrics["transformer_loading"]["checkpointed_blocks"] == 0
    assert run.metrics["transformer_loading"]["checkpointed_blocks"] == checkpointed_blocks
    losses = [event["loss"] for event in run.of_kind("step")]
    assert len(losses) == 3
    assert losses == pytest.approx([event["loss"] for event in without_checkpointing.of_kind("step")], rel=1e-3)
