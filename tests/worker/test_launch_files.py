"""launch_files.py: the files the worker hands to accelerate and DeepSpeed, golden-file tested."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.job.launch_files import (
    INHERITED_ENV_NAMES,
    accelerate_config,
    child_environment,
    deepspeed_config,
    write_launch_files,
)
from tests.support.guide_job import GUIDE_DEFAULT_PLAN, GUIDE_TRAINER
from tests.support.regroup import regrouped
from tests.support.specs import job_spec

GOLDEN_DIR = Path(__file__).parent / "golden"


def assert_matches_golden(name: str, actual: object) -> None:
    path = GOLDEN_DIR / name
    text = json.dumps(actual, indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from its golden file (UPDATE_GOLDEN=1 rewrites it)"


def test_default_plan_writes_the_guides_zero2_cpu_offload_config() -> None:
    assert_matches_golden("deepspeed_zero2_cpu_offload.json", deepspeed_config(GUIDE_DEFAULT_PLAN, GUIDE_TRAINER))


def test_zero2_never_carries_offload_param_because_deepspeed_ignores_it_there() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, offload_param="cpu")
    assert "offload_param" not in deepspeed_config(plan, GUIDE_TRAINER)["zero_optimization"]


def test_train_batch_size_is_micro_batch_times_accumulation_times_world_size() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, num_processes=4)
    trainer = regrouped(GUIDE_TRAINER, batch_size=2, gradient_accumulation_steps=3)
    config = deepspeed_config(plan, trainer)
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (24, 2, 3)


def test_zero3_parameter_offload_config_matches_golden() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, zero_stage=3, offload_param="cpu")
    assert_matches_golden("deepspeed_zero3_cpu_offload.json", deepspeed_config(plan, GUIDE_TRAINER))


def test_nvme_offload_adds_the_swap_path_and_aio_section() -> None:
    plan = replace(
        GUIDE_DEFAULT_PLAN, zero_stage=3, offload_optimizer="nvme", offload_param="nvme", nvme_path="/nvme/job-1"
    )
    config = deepspeed_config(plan, GUIDE_TRAINER)
    assert config["zero_optimization"]["offload_param"] == {
        "device": "nvme",
        "pin_memory": True,
        "nvme_path": "/nvme/job-1",
    }
    assert config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/nvme/job-1"
    assert config["aio"]["block_size"] == 1048576


def test_fp16_requests_get_the_guides_loss_scaling_block() -> None:
    config = deepspeed_config(replace(GUIDE_DEFAULT_PLAN, mixed_precision="fp16"), GUIDE_TRAINER)
    assert config["fp16"] == {
        "enabled": True,
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    assert "bf16" not in config


def test_cpu_accelerator_does_not_ask_for_pinned_memory() -> None:
    config = deepspeed_config(replace(GUIDE_DEFAULT_PLAN, accelerator="cpu"), GUIDE_TRAINER)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}


@pytest.mark.parametrize(
    ("lr_scheduler", "lr_warmup_steps"), [("constant", 0), ("constant", 100), ("cosine", 0), ("cosine", 10)]
)
def test_no_scheduler_block_so_the_trainers_own_schedule_runs(lr_scheduler: str, lr_warmup_steps: int) -> None:
    trainer = regrouped(GUIDE_TRAINER, lr_scheduler=lr_scheduler, lr_warmup_steps=lr_warmup_steps)
    assert "scheduler" not in deepspeed_config(GUIDE_DEFAULT_PLAN, trainer)


def test_adamw_writes_an_adamw_block_with_decoupled_weight_decay() -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="adamw"))
    assert config["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 2e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
    }


def test_optimizer_names_are_normalised_before_choosing_the_block() -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="Adam-W"))
    assert config["optimizer"]["type"] == "AdamW"


def test_adam_writes_an_adam_block_that_deepspeed_does_not_turn_into_adamw() -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="adam"))
    assert config["optimizer"] == {
        "type": "Adam",
        "params": {"lr": 2e-6, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "adam_w_mode": False},
    }


def test_adagrad_writes_an_adagrad_block_without_betas() -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="adagrad"))
    assert config["optimizer"] == {"type": "Adagrad", "params": {"lr": 2e-6, "eps": 1e-10, "weight_decay": 0.0}}


def test_lion_writes_a_lion_block_without_eps() -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="lion"))
    assert config["optimizer"] == {"type": "Lion", "params": {"lr": 2e-6, "betas": [0.9, 0.99], "weight_decay": 0.01}}


@pytest.mark.parametrize("name", ["adafactor", "sgd"])
def test_torch_optimizers_write_no_block_and_let_deepspeed_take_them_next_to_an_offload(name: str) -> None:
    config = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer=name))
    assert "optimizer" not in config
    assert config["zero_force_ds_cpu_optimizer"] is False


def test_torch_optimizers_without_offload_leave_deepspeeds_cpu_optimizer_check_alone() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, offload_optimizer="none")
    config = deepspeed_config(plan, regrouped(GUIDE_TRAINER, optimizer="sgd"))
    assert "optimizer" not in config
    assert "zero_force_ds_cpu_optimizer" not in config


@pytest.mark.parametrize("name", ["adamw", "adam", "adagrad", "lion", "adafactor", "sgd"])
@pytest.mark.parametrize("accelerator", ["cuda", "cpu"])
def test_without_optimizer_offload_no_optimizer_block_so_deepspeed_builds_no_gpu_kernel(
    name: str, accelerator: str
) -> None:
    # The trainer hands DeepSpeed its own optimizer (torch's fused AdamW, its Lion): DeepSpeed's FusedAdam and
    # FusedLion are CUDA ops that need nvcc to build, and the image has none.
    plan = replace(GUIDE_DEFAULT_PLAN, offload_optimizer="none", accelerator=accelerator)
    config = deepspeed_config(plan, regrouped(GUIDE_TRAINER, optimizer=name))
    assert "optimizer" not in config
    assert "zero_force_ds_cpu_optimizer" not in config


def test_deepspeed_optimizers_keep_deepspeeds_cpu_optimizer_check() -> None:
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(
        GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="lion")
    )


def test_an_unsupported_optimizer_name_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(
        ValueError,
        match=r"optimizer 'prodigy' is not supported; use one of \['adamw', 'adam', 'adagrad', 'lion', 'adafactor', 'sgd'\]",
    ):
        deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer="prodigy"))


def test_accelerate_yaml_is_the_guides_with_the_deepspeed_file(tmp_path: Path) -> None:
    config = accelerate_config(GUIDE_DEFAULT_PLAN, tmp_path / "ds_config.json")
    expected = json.loads((GOLDEN_DIR / "accelerate_zero2.json").read_text())
    expected["deepspeed_config"]["deepspeed_config_file"] = str(tmp_path / "ds_config.json")
    assert config == expected


def test_zero3_turns_on_partitioned_model_construction(tmp_path: Path) -> None:
    config = accelerate_config(replace(GUIDE_DEFAULT_PLAN, zero_stage=3, offload_param="cpu"), tmp_path / "ds.json")
    assert config["deepspeed_config"]["zero3_init_flag"] is True


def test_launchers_that_rendezvous_over_tcp_ask_accelerate_for_a_free_port(tmp_path: Path) -> None:
    # Port 0 is accelerate's "pick a free one"; its default 29500 lost a race against a concurrent launch in CI.
    deepspeed = accelerate_config(GUIDE_DEFAULT_PLAN, tmp_path / "ds.json")
    torchrun = accelerate_config(replace(GUIDE_DEFAULT_PLAN, use_deepspeed=False, num_processes=2), None)
    assert (deepspeed["main_process_port"], torchrun["main_process_port"]) == (0, 0)


def test_a_single_process_without_deepspeed_names_no_port() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, use_deepspeed=False, zero_stage=0, offload_optimizer="none", optimizer="AdamW")
    assert "main_process_port" not in accelerate_config(plan, None)


def test_plain_accelerate_without_deepspeed_keeps_mixed_precision_in_the_yaml() -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, use_deepspeed=False, zero_stage=0, offload_optimizer="none", optimizer="AdamW")
    config = accelerate_config(plan, None)
    assert (config["distributed_type"], config["mixed_precision"]) == ("NO", "bf16")
    assert "deepspeed_config" not in config


def test_environment_drops_the_guides_debug_switches_unless_asked(tmp_path: Path) -> None:
    env = child_environment(GUIDE_DEFAULT_PLAN, {"PATH": "/bin"}, cpu_count=8, torch_extensions_dir=tmp_path)
    assert "CUDA_LAUNCH_BLOCKING" not in env
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env
    assert "DS_REPORT_BUG_MODE" not in env
    debug_env = child_environment(GUIDE_DEFAULT_PLAN, {}, cpu_count=8, torch_extensions_dir=tmp_path, debug=True)
    assert (debug_env["CUDA_LAUNCH_BLOCKING"], debug_env["PYTORCH_NO_CUDA_MEMORY_CACHING"]) == ("1", "1")


def test_environment_keeps_the_guides_useful_variables(tmp_path: Path) -> None:
    env = child_environment(GUIDE_DEFAULT_PLAN, {}, cpu_count=8, torch_extensions_dir=tmp_path)
    assert {
        name: env[name]
        for name in (
            "DS_ACCELERATOR",
            "DS_SKIP_CUDA_CHECK",
            "CUDA_VISIBLE_DEVICES",
            "PYTORCH_CUDA_ALLOC_CONF",
            "TOKENIZERS_PARALLELISM",
            "CUDA_DEVICE_ORDER",
        )
    } == {
        "DS_ACCELERATOR": "cuda",
        "DS_SKIP_CUDA_CHECK": "0",
        "CUDA_VISIBLE_DEVICES": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TOKENIZERS_PARALLELISM": "false",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def test_the_trainers_cuda_allocator_uses_expandable_segments_without_max_split_size(tmp_path: Path) -> None:
    env = child_environment(GUIDE_DEFAULT_PLAN, {}, cpu_count=8, torch_extensions_dir=tmp_path)
    settings = env["PYTORCH_CUDA_ALLOC_CONF"].split(",")
    assert "expandable_segments:True" in settings
    assert not any(setting.startswith("max_split_size_mb") for setting in settings)


def test_cpu_threads_are_the_cores_per_process_not_one(tmp_path: Path) -> None:
    env = child_environment(
        replace(GUIDE_DEFAULT_PLAN, num_processes=2), {}, cpu_count=16, torch_extensions_dir=tmp_path
    )
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["NUMEXPR_NUM_THREADS"]) == ("8", "8", "8")


def test_environment_inherits_only_the_allow_list(tmp_path: Path) -> None:
    parent = {
        "PATH": "/usr/bin",
        "BUCKET_SECRET_ACCESS_KEY": "canary-secret",
        "BUCKET_ACCESS_KEY_ID": "canary-id",
        "RANDOM_VAR": "x",
    }
    env = child_environment(GUIDE_DEFAULT_PLAN, parent, cpu_count=2, torch_extensions_dir=tmp_path)
    assert env["PATH"] == "/usr/bin"
    assert not {"BUCKET_SECRET_ACCESS_KEY", "BUCKET_ACCESS_KEY_ID", "RANDOM_VAR"} & env.keys()
    assert not any(name.startswith(("BUCKET_", "AWS_")) for name in INHERITED_ENV_NAMES)


def test_launch_files_are_written_and_read_back_identically(tmp_path: Path) -> None:
    files = write_launch_files(tmp_path, GUIDE_DEFAULT_PLAN, GUIDE_TRAINER)
    assert files.deepspeed_config is not None
    assert json.loads(files.deepspeed_config.read_text()) == deepspeed_config(GUIDE_DEFAULT_PLAN, GUIDE_TRAINER)
    assert yaml.safe_load(files.accelerate_config.read_text()) == accelerate_config(
        GUIDE_DEFAULT_PLAN, files.deepspeed_config
    )
    assert TrainerConfig.read(files.trainer_config) == GUIDE_TRAINER


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_produces_a_config_deepspeed_accepts(stage: int) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    plan = replace(GUIDE_DEFAULT_PLAN, zero_stage=stage, offload_param="cpu" if stage == 3 else "none")
    parsed = DeepSpeedConfig(deepspeed_config(plan, GUIDE_TRAINER), mpu=None)
    assert parsed.zero_optimization_stage == stage
    assert parsed.train_batch_size == 1


@pytest.mark.parametrize("name", ["adamw", "adam", "adagrad", "lion", "adafactor", "sgd"])
def test_every_optimizer_produces_a_config_deepspeed_accepts(name: str) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    raw = deepspeed_config(GUIDE_DEFAULT_PLAN, regrouped(GUIDE_TRAINER, optimizer=name))
    expected = raw["optimizer"]["type"].lower() if "optimizer" in raw else None
    assert DeepSpeedConfig(raw, mpu=None).optimizer_name == expected


def test_the_plans_base_precision_reaches_the_trainer(tmp_path: Path) -> None:
    from fluxbooth.job.launch_files import trainer_config_for
    from fluxbooth.request.model import parse_request

    request = parse_request(
        {"model_name": "m", "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==", "instance_prompt": "a photo of sks dog"}
    )
    plan = replace(GUIDE_DEFAULT_PLAN, training_type="lora", offload_optimizer="none", base_precision="nf4")
    trainer = trainer_config_for(
        job_spec(request),
        plan,
        base_model="/models/flux",
        instance_dir=tmp_path / "instance",
        class_dir=None,
        job_dir=tmp_path,
    )
    assert (trainer.training_type, trainer.memory.base_precision) == ("lora", "nf4")
    assert TrainerConfig.read(write_launch_files(tmp_path, plan, trainer).trainer_config).memory.base_precision == "nf4"


@pytest.mark.parametrize(
    ("fields", "measured"), [({}, False), ({"learning_check": True}, True), ({"debug": True}, False)]
)
def test_only_a_learning_check_request_measures_the_fixed_noise_loss(
    fields: dict[str, bool], measured: bool, tmp_path: Path
) -> None:
    from fluxbooth.job.launch_files import trainer_config_for
    from fluxbooth.request.model import parse_request

    request = parse_request(
        {
            "model_name": "m",
            "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
            "instance_prompt": "a photo of sks dog",
            **fields,
        }
    )
    trainer = trainer_config_for(
        job_spec(request),
        GUIDE_DEFAULT_PLAN,
        base_model="/models/flux",
        instance_dir=tmp_path / "instance",
        class_dir=None,
        job_dir=tmp_path,
    )
    assert trainer.measure_fixed_noise_loss is measured


def test_the_learning_check_leaves_the_allocator_alone(tmp_path: Path) -> None:
    # job.py passes only the request's debug to child_environment: learning_check has no say in the environment.
    import inspect

    assert "learning_check" not in inspect.signature(child_environment).parameters
    env = child_environment(GUIDE_DEFAULT_PLAN, {}, cpu_count=8, torch_extensions_dir=tmp_path)
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env and "CUDA_LAUNCH_BLOCKING" not in env
