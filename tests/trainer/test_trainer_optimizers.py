"""Other strategies, every optimizer and schedule, and hand-written launch configs.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.support.trainer_jobs import (
    TrainerJob,
    TrainerRun,
    assert_refused,
    assert_succeeded,
    make_plan,
    new_job,
    read_json,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# Other strategies and optimizers
# --------------------------------------------------------------------------------------------------


def test_without_deepspeed_a_torch_optimizer_trains_under_plain_accelerate(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(use_deepspeed=False, training_type="lora")
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2, optimizer="adafactor").launch()

    assert_succeeded(run)
    assert (run.metrics["optimizer"], run.metrics["zero_stage"]) == ("Adafactor", 0)
    assert run.artifact("lora_diffusers").is_file()


def test_zero1_with_optimizer_offload_trains(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(zero_stage=1), steps=2).launch()

    assert_succeeded(run)
    assert (run.metrics["optimizer"], run.metrics["zero_stage"]) == ("DeepSpeedCPUAdam", 1)


# The worker's default plan (full fine-tune, ZeRO-2, optimizer offloaded to the CPU, bf16) with the DeepSpeed JSON
# launch_files.py writes for each name: DeepSpeed's CPU kernels for its block types (the first run builds each CPU op:
# minutes), the torch optimizer itself for the others. adamw and sgd run in the warm-up tests below; adam is
# adamw's kernel with adam_w_mode off (tests/worker/test_launch_files.py).
@pytest.mark.parametrize(
    ("name", "implementation"),
    [("adagrad", "DeepSpeedCPUAdagrad"), ("lion", "DeepSpeedCPULion"), ("adafactor", "Adafactor")],
)
def test_every_optimizer_trains_under_the_default_plan_with_its_own_implementation(
    name: str, implementation: str, tiny_base: Path, tmp_path: Path
) -> None:
    run = new_job(tmp_path / "job", tiny_base, steps=2, optimizer=name).launch()

    assert_succeeded(run)
    assert run.metrics["optimizer"] == implementation
    assert [event["step"] for event in run.of_kind("step")] == [1, 2]
    assert math.isfinite(run.metrics["final_loss"])


# Not offloaded (a GPU plan's JSON): no optimizer block, so DeepSpeed builds none of its CUDA kernels; the trainer
# hands it its own Lion (torch's fused AdamW likewise; tests/trainer/test_torch_optimizers.py compares their steps).
def test_without_optimizer_offload_lion_is_the_trainers_own_handed_to_deepspeed(
    tiny_base: Path, tmp_path: Path
) -> None:
    run = new_job(
        tmp_path / "job", tiny_base, plan=make_plan(offload_optimizer="none"), steps=2, optimizer="lion"
    ).launch()

    assert_succeeded(run)
    assert (run.metrics["optimizer"], run.metrics["zero_stage"]) == ("Lion", 2)
    assert "optimizer" not in read_json(tmp_path / "job" / "config" / "ds_config.json")
    assert math.isfinite(run.metrics["final_loss"])


# DeepSpeed steps the schedule next to its own optimizer (adamw); the trainer steps it next to a torch one (sgd).
@pytest.mark.parametrize(("name", "implementation"), [("adamw", "DeepSpeedCPUAdam"), ("sgd", "SGD")])
def test_warmup_under_deepspeed_starts_above_zero_and_rises_to_the_learning_rate(
    name: str, implementation: str, tiny_base: Path, tmp_path: Path
) -> None:
    run = new_job(tmp_path / "job", tiny_base, steps=3, lr_warmup_steps=2, optimizer=name).launch()

    assert_succeeded(run)
    assert run.metrics["optimizer"] == implementation
    rates = [event["lr"] for event in run.of_kind("step")]
    assert rates == pytest.approx([1e-4 / 3, 2e-4 / 3, 1e-4])


def test_cosine_without_warmup_under_deepspeed_starts_at_the_full_learning_rate(
    tiny_base: Path, tmp_path: Path
) -> None:
    run = new_job(tmp_path / "job", tiny_base, steps=3, lr_scheduler="cosine", lr_warmup_steps=0).launch()

    assert_succeeded(run)
    rates = [event["lr"] for event in run.of_kind("step")]
    assert rates == pytest.approx([1e-4, 0.75e-4, 0.25e-4])


def test_cosine_schedule_decays_the_learning_rate(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(
        tmp_path / "job",
        tiny_base,
        plan=make_plan(use_deepspeed=False),
        steps=3,
        lr_scheduler="cosine",
        lr_warmup_steps=1,
    ).launch()

    assert_succeeded(run)
    rates = [event["lr"] for event in run.of_kind("step")]
    assert rates == pytest.approx([0.5e-4, 1e-4, 0.5e-4])


def test_unknown_optimizer_is_refused_with_the_supported_names(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(use_deepspeed=False), optimizer="prodigy").launch()
    assert_refused(run, "invalid_config", "'prodigy'", "adamw", "adafactor", "lion")


def launch_with_deepspeed_json(job: TrainerJob, edit: Any) -> TrainerRun:
    """Launch `job` with the DeepSpeed JSON launch_files.py writes, changed by `edit` (a hand-written JSON)."""
    files = job.write()
    deepspeed_json = read_json(files.deepspeed_config)
    edit(deepspeed_json)
    files.deepspeed_config.write_text(json.dumps(deepspeed_json))
    job.write = lambda: files  # type: ignore[method-assign]  # launch the edited files as they are
    return job.launch()


def test_optimizer_that_disagrees_with_the_deepspeed_json_is_refused_not_swapped(
    tiny_base: Path, tmp_path: Path
) -> None:
    job = new_job(tmp_path / "job", tiny_base, optimizer="adafactor")
    run = launch_with_deepspeed_json(job, lambda ds: ds.update(optimizer={"type": "AdamW", "params": {"lr": 1e-4}}))
    assert_refused(run, "invalid_config", "'adafactor'", "'AdamW'")


def test_torch_optimizer_that_accelerate_would_swap_for_deepspeed_cpu_adam_is_refused(
    tiny_base: Path, tmp_path: Path
) -> None:
    job = new_job(tmp_path / "job", tiny_base, optimizer="sgd")
    run = launch_with_deepspeed_json(job, lambda ds: ds.pop("zero_force_ds_cpu_optimizer"))
    assert_refused(run, "invalid_config", "'sgd'", '"zero_force_ds_cpu_optimizer": false', "DeepSpeedCPUAdam")


def test_nvme_offload_without_a_way_to_build_the_async_io_op_is_reported_as_missing_libaio(
    tiny_base: Path, tmp_path: Path
) -> None:
    plan = replace(
        make_plan(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"), nvme_path=str(tmp_path / "swap")
    )
    job = new_job(tmp_path / "job", tiny_base, plan=plan)
    # DeepSpeed decides whether async_io can be built by compiling and linking a probe against libaio with $CC;
    # a compiler that always fails is what a machine without libaio's headers looks like to it.
    job.extra_env["CC"] = "/bin/false"

    assert_refused(job.launch(), "missing_libaio", "libaio-dev", "offload 'cpu'")


def test_nvme_offload_below_zero3_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(zero_stage=2, offload_optimizer="nvme")).launch()
    assert_refused(run, "invalid_config", "ZeRO stage 3", "silently")


def test_fp16_on_deepspeeds_cpu_accelerator_is_refused_with_advice(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(mixed_precision="fp16")).launch()
    assert_refused(run, "invalid_config", "fp16", "bf16")


# --------------------------------------------------------------------------------------------------
# Hand-written launch configs
# --------------------------------------------------------------------------------------------------

# DiffSynth-Studio's low-VRAM ZeRO-3 CPU-offload recipe (seed 004), as published: "auto" everywhere,
# no optimizer block, no mixed_precision in the accelerate YAML.
DIFFSYNTH_ZERO3_OFFLOAD = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": False,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e8,
        "stage3_max_reuse_distance": 1e8,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "activation_checkpointing": {
        "partition_activations": False,
        "cpu_checkpointing": False,
        "contiguous_memory_optimization": False,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_hand_written_diffsynth_zero3_config_with_auto_values_trains(tiny_base: Path, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    import yaml

    from fluxbooth.contract.events import DoneEvent, StepEvent, parse_event

    job = new_job(
        tmp_path / "job",
        tiny_base,
        plan=make_plan(zero_stage=3, offload_param="cpu"),
        steps=2,
        gradient_accumulation_steps=2,
    )
    files = job.write()
    ds_file = tmp_path / "ds_z3_cpuoffload.json"
    ds_file.write_text(json.dumps(DIFFSYNTH_ZERO3_OFFLOAD))
    accelerate_file = tmp_path / "deepspeed_zero3_cpuoffload.yaml"
    accelerate_file.write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "debug": True,
                "distributed_type": "DEEPSPEED",
                "downcast_bf16": "no",
                "deepspeed_config": {"deepspeed_config_file": str(ds_file), "zero3_init_flag": True},
                "enable_cpu_affinity": False,
                "machine_rank": 0,
                "main_training_function": "main",
                "num_machines": 1,
                "num_processes": 1,
                "rdzv_backend": "static",
                "same_network": True,
                "tpu_env": [],
                "tpu_use_cluster": False,
                "tpu_use_sudo": False,
                "use_cpu": False,
            }
        )
    )
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(accelerate_file),
            "-m",
            "fluxbooth.train",
            "--config",
            str(files.trainer_config),
        ],
        env=job.environment(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    events = [event for line in completed.stdout.splitlines() if (event := parse_event(line))]

    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    (done,) = [event for event in events if isinstance(event, DoneEvent)]
    assert (done.metrics["zero_stage"], done.metrics["transformer_loading"]["method"]) == (3, "zero3_init")
    # No optimizer block: the trainer's torch AdamW, which accelerate swaps for DeepSpeedCPUAdam when offloading.
    assert done.metrics["optimizer"] == "DeepSpeedCPUAdam"
    assert [event.step for event in events if isinstance(event, StepEvent)] == [1, 2]
