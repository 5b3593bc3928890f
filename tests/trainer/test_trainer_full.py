"""The full fine-tune under ZeRO-2 (the worker's default plan) and ZeRO-3, and the trainer's failures.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fluxbooth.contract.names import EXIT_NAN_LOSS
from tests.support.trainer_jobs import (
    TrainerRun,
    assert_succeeded,
    base_image,
    load_pipeline,
    make_plan,
    new_job,
    read_json,
    render,
    transformer_state,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# Full fine-tune, ZeRO-2, optimizer offloaded to the CPU: the worker's default plan.
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_zero2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    job = new_job(tmp_path_factory.mktemp("full-zero2"), tiny_base, steps=3, gradient_accumulation_steps=2)
    (Path(job.config.instance_dir) / "photo1.txt").write_text("a photo of sks dog on the grass\n")
    run = job.launch()
    assert_succeeded(run)
    return run


def test_full_zero2_steps_with_deepspeed_cpu_adam(full_zero2: TrainerRun) -> None:
    assert full_zero2.metrics["optimizer"] == "DeepSpeedCPUAdam"
    metrics = full_zero2.metrics
    assert (metrics["zero_stage"], metrics["offload_optimizer"], metrics["offload_param"]) == (2, "cpu", "none")
    assert (metrics["training_type"], metrics["mixed_precision"], metrics["export_formats"]) == (
        "full",
        "bf16",
        ["diffusers"],
    )


def test_full_zero2_reports_one_finite_step_event_per_optimizer_step(full_zero2: TrainerRun) -> None:
    steps = full_zero2.of_kind("step")
    assert [event["step"] for event in steps] == [1, 2, 3]
    assert all(event["total"] == 3 for event in steps)
    assert all(math.isfinite(event["loss"]) and event["loss"] > 0 for event in steps)
    assert all(event["lr"] == pytest.approx(1e-4) for event in steps)
    assert all(event["seconds_per_step"] > 0 for event in steps)
    assert full_zero2.metrics["final_loss"] == steps[-1]["loss"]


def test_full_zero2_announces_its_stages_in_order(full_zero2: TrainerRun) -> None:
    stages = [event["stage"] for event in full_zero2.of_kind("stage")]
    first_seen = list(dict.fromkeys(stages))
    assert first_seen == ["load", "cache", "train", "save", "export"]


def test_full_zero2_saved_transformer_differs_from_the_base(full_zero2: TrainerRun, tiny_base: Path) -> None:
    trained = transformer_state(full_zero2.artifact("diffusers_transformer"))
    base = transformer_state(tiny_base / "transformer")
    assert trained.keys() == base.keys()
    changed = [name for name in base if not torch.equal(trained[name], base[name])]
    assert len(changed) > len(base) // 2


def test_full_zero2_saved_transformer_is_bf16_safetensors(full_zero2: TrainerRun) -> None:
    folder = full_zero2.artifact("diffusers_transformer")
    weights = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert not list(folder.glob("*.bin"))


def test_full_zero2_saved_transformer_changes_the_pipeline_output(full_zero2: TrainerRun, tiny_base: Path) -> None:
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(
        full_zero2.artifact("diffusers_transformer"), torch_dtype=torch.float32
    )
    trained_image = render(load_pipeline(tiny_base, transformer=transformer))
    assert trained_image.shape == (64, 64, 3)
    assert float(abs(trained_image - base_image(tiny_base)).max()) > 1e-4


def test_the_fixed_noise_loss_is_not_measured_unless_asked(full_zero2: TrainerRun) -> None:
    statuses = [event.get("status") for event in full_zero2.of_kind("stage")]
    assert "measuring_fixed_noise_loss" not in statuses
    assert "fixed_noise_loss" not in full_zero2.metrics


def test_caption_files_become_the_prompts_of_their_images(full_zero2: TrainerRun) -> None:
    (cache_file,) = Path(full_zero2.config.cache_dir).glob("instance-*.pt")
    cached = torch.load(cache_file, weights_only=True)
    assert cached["prompts"] == ["a photo of sks dog", "a photo of sks dog on the grass"]
    assert cached["prompt_index"].tolist() == [0, 1, 0]


def test_metrics_json_holds_the_done_payload(full_zero2: TrainerRun) -> None:
    written = read_json(full_zero2.output_dir / "metrics.json")
    assert written["metrics"] == full_zero2.metrics
    assert {"name": "transformer", "path": "transformer", "kind": "diffusers_transformer"} in written["artifacts"]
    assert {"cache", "train", "save", "export"} <= set(written["metrics"]["seconds_per_stage"])
    assert written["metrics"]["peak_host_rss_bytes"] > 100 * 1024 * 1024


def test_text_encoders_and_vae_are_released_before_the_transformer_loads(full_zero2: TrainerRun) -> None:
    released = full_zero2.metrics["released_before_training"]
    assert sorted(released) == ["text_encoder", "text_encoder_2", "vae"]
    assert not full_zero2.of_kind("warning")


def test_only_the_main_process_prints_events(full_zero2: TrainerRun) -> None:
    assert len(full_zero2.of_kind("done")) == 1


# --------------------------------------------------------------------------------------------------
# Full fine-tune under ZeRO-3 with parameter offload
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_zero3(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    job = new_job(
        tmp_path_factory.mktemp("full-zero3"),
        tiny_base,
        plan=plan,
        steps=2,
        export_formats=("diffusers", "single_file"),
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def test_full_zero3_builds_the_transformer_partitioned_on_the_cpu(full_zero3: TrainerRun) -> None:
    loading = full_zero3.metrics["transformer_loading"]
    assert loading["method"] == "zero3_init"
    assert loading["partitioned"] == loading["parameters"] > 0
    assert loading["materialised_elements"] == 0
    assert loading["partition_devices"] == ["cpu"]
    assert full_zero3.metrics["optimizer"] == "DeepSpeedCPUAdam"
    assert (full_zero3.metrics["offload_optimizer"], full_zero3.metrics["offload_param"]) == ("cpu", "cpu")


def test_full_zero3_gathered_transformer_reloads_and_changes_the_output(
    full_zero3: TrainerRun, tiny_base: Path
) -> None:
    from diffusers import FluxTransformer2DModel

    folder = full_zero3.artifact("diffusers_transformer")
    trained, base = transformer_state(folder), transformer_state(tiny_base / "transformer")
    assert trained.keys() == base.keys()
    assert all(trained[name].shape == base[name].shape for name in base)
    transformer = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.float32)
    image = render(load_pipeline(tiny_base, transformer=transformer))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_full_zero3_single_file_holds_the_same_weights_in_the_original_layout(full_zero3: TrainerRun) -> None:
    from diffusers import FluxTransformer2DModel

    from fluxbooth.train.export.key_layouts import fused_split_sizes, original_to_diffusers_transformer

    single = load_file(full_zero3.artifact("single_file_transformer"))
    assert "double_blocks.0.img_attn.qkv.weight" in single and "single_blocks.0.linear1.weight" in single
    folder = full_zero3.artifact("diffusers_transformer")
    split_sizes = fused_split_sizes(FluxTransformer2DModel.load_config(folder))
    converted = original_to_diffusers_transformer(single, split_sizes)
    saved = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[name], saved[name]) for name in saved)


# --------------------------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------------------------


def test_nan_loss_stops_with_an_error_event_and_trainer_exit_status_3(tiny_base: Path, tmp_path: Path) -> None:
    broken_base = tmp_path / "broken-base"
    shutil.copytree(tiny_base, broken_base)
    weights_file = broken_base / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(weights_file)
    weights["proj_out.bias"] = torch.full_like(weights["proj_out.bias"], float("nan"))
    save_file(weights, weights_file, metadata={"format": "pt"})

    run = new_job(tmp_path / "job", broken_base, steps=3).launch()

    # torch's elastic agent under `accelerate launch` exits 1 for any failed child and logs the child's status.
    assert run.returncode != 0
    assert f"exitcode  : {EXIT_NAN_LOSS}" in run.log, run.log[-3000:]
    (error,) = run.of_kind("error")
    assert (error["code"], error["step"]) == ("nan_loss", 1)
    assert "learning_rate" in error["message"]
    assert not run.of_kind("done")


def test_empty_instance_folder_is_reported_as_invalid_dataset(tiny_base: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "job", tiny_base, images=0)
    Path(job.config.instance_dir).mkdir(parents=True, exist_ok=True)

    run = job.launch()

    assert run.returncode != 0
    (error,) = run.of_kind("error")
    assert error["code"] == "invalid_dataset"
    assert "instance" in error["message"]


def test_full_zero2_frees_the_engine_and_its_offloaded_optimizer_before_export_begins(full_zero2: TrainerRun) -> None:
    assert full_zero2.metrics["alive_at_export"] == []
