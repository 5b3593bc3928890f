"""Several processes: on one machine, and as two machines on localhost.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.trainer_jobs import (
    TrainerRun,
    assert_succeeded,
    base_image,
    lora_pipeline,
    make_plan,
    new_job,
    render,
    transformer_state,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# Several processes: two on one machine, and two single-process "machines" on localhost
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes_zero2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = new_job(
        tmp_path_factory.mktemp("two-processes"), tiny_base, plan=make_plan(num_processes=2), steps=2
    ).launch()
    assert_succeeded(run)
    return run


def test_two_processes_train_as_one_job_of_world_size_two(two_processes_zero2: TrainerRun) -> None:
    assert two_processes_zero2.metrics["num_processes"] == 2
    assert [event["step"] for event in two_processes_zero2.of_kind("step")] == [1, 2]
    assert len(two_processes_zero2.of_kind("done")) == 1


def test_two_processes_export_weights_shaped_like_the_base(two_processes_zero2: TrainerRun, tiny_base: Path) -> None:
    trained = transformer_state(two_processes_zero2.artifact("diffusers_transformer"))
    base = transformer_state(tiny_base / "transformer")
    assert {name: tensor.shape for name, tensor in trained.items()} == {
        name: tensor.shape for name, tensor in base.items()
    }


def test_two_machines_on_localhost_train_the_same_job_as_two_local_processes(
    two_processes_zero2: TrainerRun, tiny_base: Path, tmp_path: Path
) -> None:
    main_node, other_node = new_job(
        tmp_path / "job", tiny_base, plan=make_plan(num_processes=2), steps=2
    ).launch_as_nodes(2)

    assert (main_node.returncode, other_node.returncode) == (0, 0), main_node.log[-3000:] + other_node.log[-3000:]
    assert main_node.metrics["num_processes"] == 2
    assert other_node.events == []  # only the global main process reports
    # Same world size, seed and data order: the same losses, step for step.
    assert [event["loss"] for event in main_node.of_kind("step")] == pytest.approx(
        [event["loss"] for event in two_processes_zero2.of_kind("step")], rel=1e-5
    )
    trained = transformer_state(main_node.artifact("diffusers_transformer"))
    reference = transformer_state(two_processes_zero2.artifact("diffusers_transformer"))
    assert {name: tensor.shape for name, tensor in trained.items()} == {
        name: tensor.shape for name, tensor in reference.items()
    }


@pytest.fixture(scope="module")
def two_processes_zero3_prior(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    """A LoRA under ZeRO-3 over two processes with prior preservation: its class images rendered by both ranks
    together, each holding half of every layer."""
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu", num_processes=2)
    run = new_job(
        tmp_path_factory.mktemp("two-processes-zero3"),
        tiny_base,
        plan=plan,
        steps=2,
        with_prior_preservation=True,
        num_class_images=3,
    ).launch()
    assert_succeeded(run)
    return run


def test_two_processes_lora_under_zero3_export_a_loadable_adapter(
    two_processes_zero3_prior: TrainerRun, tiny_base: Path
) -> None:
    assert two_processes_zero3_prior.metrics["num_processes"] == 2
    image = render(lora_pipeline(tiny_base, two_processes_zero3_prior.artifact("lora_diffusers")))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_two_processes_under_zero3_render_every_class_image_together(two_processes_zero3_prior: TrainerRun) -> None:
    folder = Path(two_processes_zero3_prior.config.cache_dir) / "class_images"
    assert sorted(path.name for path in folder.iterdir()) == ["class_00000.png", "class_00001.png", "class_00002.png"]
    (ready,) = [event for event in two_processes_zero3_prior.of_kind("stage") if event.get("status") == "ready"]
    assert ready["class_images"] == 3


def test_two_processes_without_deepspeed_train_as_one_data_parallel_group(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(use_deepspeed=False, num_processes=2)
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2, optimizer="adamw").launch()

    assert_succeeded(run)
    assert (run.metrics["num_processes"], run.metrics["zero_stage"], run.metrics["optimizer"]) == (2, 0, "AdamW")
    trained, base = (
        transformer_state(run.artifact("diffusers_transformer")),
        transformer_state(tiny_base / "transformer"),
    )
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[name], base[name]) for name in base)


def test_two_processes_without_zero3_share_out_the_class_images(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(training_type="lora", num_processes=2)
    run = new_job(
        tmp_path / "job", tiny_base, plan=plan, steps=1, with_prior_preservation=True, num_class_images=3
    ).launch()

    assert_succeeded(run)
    folder = Path(run.config.cache_dir) / "class_images"
    assert sorted(path.name for path in folder.iterdir()) == ["class_00000.png", "class_00001.png", "class_00002.png"]
    (ready,) = [event for event in run.of_kind("stage") if event.get("status") == "ready"]
    assert ready["class_images"] == 3
