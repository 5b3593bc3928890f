"""The real trainer on the tiny FLUX model, launched by the real `accelerate launch` with the DeepSpeed
and accelerate files `fluxbooth.configs` writes, DeepSpeed running on the CPU accelerator.

Each module-scoped fixture is one training run; the tests read what it produced. Runs are a few
steps at 64x64 (10-40 s each on 2 cores)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fluxbooth.tiny import build_tiny_pipeline
from fluxbooth.train.names import EXIT_NAN_LOSS
from tests.trainer_jobs import TrainerJob, TrainerRun, make_images, make_plan, new_job, read_json

pytestmark = pytest.mark.slow

PROMPT = "a photo of sks dog"


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("base") / "tiny-flux", seed=0)


def base_image(base: Path, **pipeline_overrides: Any) -> Any:
    return render(load_pipeline(base, **pipeline_overrides))


def load_pipeline(base: Path, **overrides: Any) -> Any:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(base, **overrides)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def render(pipeline: Any) -> Any:
    return pipeline(
        PROMPT, height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np"
    ).images[0]


def transformer_state(folder: Path) -> dict[str, torch.Tensor]:
    from diffusers import FluxTransformer2DModel

    return {name: tensor.float() for name, tensor in FluxTransformer2DModel.from_pretrained(folder).state_dict().items()}


def assert_succeeded(run: TrainerRun) -> None:
    assert run.returncode == 0, run.log[-6000:]


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
    assert (metrics["training_type"], metrics["mixed_precision"], metrics["export_formats"]) == ("full", "bf16", ["diffusers"])


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

    transformer = FluxTransformer2DModel.from_pretrained(full_zero2.artifact("diffusers_transformer"), torch_dtype=torch.float32)
    trained_image = render(load_pipeline(tiny_base, transformer=transformer))
    assert trained_image.shape == (64, 64, 3)
    assert float(abs(trained_image - base_image(tiny_base)).max()) > 1e-4


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


# --------------------------------------------------------------------------------------------------
# LoRA under ZeRO-2 (optimizer offload) and ZeRO-3 (parameter offload)
# --------------------------------------------------------------------------------------------------

LORA_FORMATS = ("diffusers", "comfyui")


@pytest.fixture(scope="module")
def lora_zero2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora")
    run = new_job(tmp_path_factory.mktemp("lora-zero2"), tiny_base, plan=plan, steps=3, export_formats=LORA_FORMATS).launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def lora_zero3(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu")
    run = new_job(tmp_path_factory.mktemp("lora-zero3"), tiny_base, plan=plan, steps=2, export_formats=LORA_FORMATS).launch()
    assert_succeeded(run)
    return run


def lora_pipeline(base: Path, lora_file: Path) -> Any:
    pipeline = load_pipeline(base)
    pipeline.load_lora_weights(lora_file.parent, weight_name=lora_file.name)
    return pipeline


@pytest.mark.parametrize("run_name", ["lora_zero2", "lora_zero3"])
def test_lora_trains_with_deepspeed_cpu_adam(run_name: str, request: pytest.FixtureRequest) -> None:
    run: TrainerRun = request.getfixturevalue(run_name)
    assert run.metrics["optimizer"] == "DeepSpeedCPUAdam"
    assert run.metrics["training_type"] == "lora"
    assert all(math.isfinite(event["loss"]) for event in run.of_kind("step"))


@pytest.mark.parametrize("run_name", ["lora_zero2", "lora_zero3"])
def test_lora_diffusers_export_loads_with_load_lora_weights_and_changes_the_output(
    run_name: str, request: pytest.FixtureRequest, tiny_base: Path
) -> None:
    run: TrainerRun = request.getfixturevalue(run_name)
    image = render(lora_pipeline(tiny_base, run.artifact("lora_diffusers")))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


@pytest.mark.parametrize("run_name", ["lora_zero2", "lora_zero3"])
def test_lora_export_keys_have_no_deepspeed_or_peft_leftovers(run_name: str, request: pytest.FixtureRequest) -> None:
    run: TrainerRun = request.getfixturevalue(run_name)
    keys = list(load_file(run.artifact("lora_diffusers")))
    assert keys and all(key.startswith("transformer.") for key in keys)
    assert not [key for key in keys if "module." in key or ".default" in key]
    assert {key.rsplit(".", 2)[-2] for key in keys} == {"lora_A", "lora_B"}


def test_lora_export_restores_alpha_when_loaded(lora_zero2: TrainerRun, tiny_base: Path) -> None:
    pipeline = lora_pipeline(tiny_base, lora_zero2.artifact("lora_diffusers"))
    (adapter_config,) = pipeline.transformer.peft_config.values()
    assert (adapter_config.r, adapter_config.lora_alpha) == (4, 8.0)


def test_lora_comfyui_export_changes_each_layer_like_the_diffusers_export(lora_zero2: TrainerRun, tiny_base: Path) -> None:
    from diffusers import FluxTransformer2DModel

    from fluxbooth.train.formats import (
        comfyui_lora_effects,
        diffusers_effects_as_comfyui,
        diffusers_lora_effects,
        fused_split_sizes,
    )

    comfy = load_file(lora_zero2.artifact("lora_comfyui"))
    assert all(key.startswith("lora_unet_") for key in comfy)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in comfy
    diffusers_lora = {key.removeprefix("transformer."): value for key, value in load_file(lora_zero2.artifact("lora_diffusers")).items()}
    split_sizes = fused_split_sizes(FluxTransformer2DModel.load_config(tiny_base, subfolder="transformer"))
    expected = diffusers_effects_as_comfyui(diffusers_lora_effects(diffusers_lora, alpha=8.0, rank=4), split_sizes)
    got = comfyui_lora_effects(comfy)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], rtol=1e-2, atol=1e-4), name


def test_lora_zero3_builds_the_base_partitioned_on_the_cpu(lora_zero3: TrainerRun) -> None:
    loading = lora_zero3.metrics["transformer_loading"]
    assert loading["method"] == "zero3_init"
    assert loading["partitioned"] == loading["parameters"] > 0
    assert loading["materialised_elements"] == 0
    assert loading["partition_devices"] == ["cpu"]


# --------------------------------------------------------------------------------------------------
# Full fine-tune under ZeRO-3 with parameter offload
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def full_zero3(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    job = new_job(tmp_path_factory.mktemp("full-zero3"), tiny_base, plan=plan, steps=2, export_formats=("diffusers", "single_file"))
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


def test_full_zero3_gathered_transformer_reloads_and_changes_the_output(full_zero3: TrainerRun, tiny_base: Path) -> None:
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

    from fluxbooth.train.formats import fused_split_sizes, original_to_diffusers_transformer

    single = load_file(full_zero3.artifact("single_file_transformer"))
    assert "double_blocks.0.img_attn.qkv.weight" in single and "single_blocks.0.linear1.weight" in single
    folder = full_zero3.artifact("diffusers_transformer")
    split_sizes = fused_split_sizes(FluxTransformer2DModel.load_config(folder))
    converted = original_to_diffusers_transformer(single, split_sizes)
    saved = load_file(folder / "diffusion_pytorch_model.safetensors")
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[name], saved[name]) for name in saved)


# --------------------------------------------------------------------------------------------------
# ZeRO-3 with NVMe offload (DeepSpeed's async_io op over libaio; CI installs libaio-dev)
# --------------------------------------------------------------------------------------------------
# DeepSpeed only swaps what is worth an I/O: tensors of at least 1 MiB (async_io's minimum), parameters beyond
# `max_in_cpu` elements (default 1e9: FLUX's 11.9e9 spill to disk, a small model never does; 0 here) and above
# `stage3_param_persistence_threshold` (the worker's 1e5 keeps every tiny parameter; 0 here). The tiny
# transformer's largest matrix is 16 KiB, so these runs use a wider one (one block of each kind, 8.5 M
# parameters, feed-forward matrices of 1.1 MiB).
NVME_TEST_TRANSFORMER = {"attention_head_dim": 192, "axes_dims_rope": [32, 80, 80], "num_layers": 1, "num_single_layers": 1}
MIB = 1 << 20


@pytest.fixture(scope="module")
def wider_tiny_base(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusers import FluxTransformer2DModel

    base = tmp_path_factory.mktemp("wider") / "tiny-flux"
    shutil.copytree(tiny_base, base)
    config = dict(FluxTransformer2DModel.load_config(base / "transformer"), **NVME_TEST_TRANSFORMER)
    torch.manual_seed(0)
    shutil.rmtree(base / "transformer")
    FluxTransformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(base / "transformer")
    return base


def nvme_job(root: Path, base: Path, training_type: str, **overrides: Any) -> TrainerJob:
    plan = replace(
        make_plan(zero_stage=3, training_type=training_type, offload_optimizer="nvme", offload_param="nvme"),
        nvme_path=str(root / "swap"),
    )
    job = new_job(root / "job", base, plan=plan, steps=2, **overrides)
    files = job.write()
    ds_config = read_json(files.deepspeed_config)
    zero = ds_config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 0
    zero["offload_param"].update(max_in_cpu=0, buffer_size=2**20)
    zero["stage3_prefetch_bucket_size"] = 0
    files.deepspeed_config.write_text(json.dumps(ds_config))
    job.write = lambda: files  # type: ignore[method-assign]  # launch the patched files as they are
    return job


@pytest.fixture(scope="module")
def full_nvme(libaio: None, wider_tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    root = tmp_path_factory.mktemp("full-nvme")
    job = nvme_job(root, wider_tiny_base, "full")
    # What a crashed earlier job leaves behind: stale swap state is a known cause of crashes on resume.
    (root / "swap" / "zero_stage_3" / "optimizer" / "rank0").mkdir(parents=True)
    (root / "swap" / "zero_stage_3" / "optimizer" / "rank0" / "stale.tensor.swp").write_bytes(b"\0" * 4096)
    run = job.launch()
    assert_succeeded(run)
    return run


def test_full_zero3_nvme_swaps_parameters_and_optimizer_state_to_disk(full_nvme: TrainerRun, wider_tiny_base: Path) -> None:
    metrics = full_nvme.metrics
    assert (metrics["zero_stage"], metrics["offload_optimizer"], metrics["offload_param"]) == (3, "nvme", "nvme")
    assert metrics["optimizer"] == "DeepSpeedCPUAdam"
    parameters = sum(tensor.numel() for tensor in transformer_state(wider_tiny_base / "transformer").values())
    # fp32 master weights and both Adam moments of every parameter live in swap files.
    assert metrics["nvme_swap_peak_bytes"]["optimizer"] >= 12 * parameters
    assert metrics["nvme_swap_peak_bytes"]["params"] >= MIB


def test_full_zero3_nvme_starts_from_an_empty_swap_folder(full_nvme: TrainerRun) -> None:
    swap = Path(full_nvme.job_dir).parent / "swap"
    assert not (swap / "zero_stage_3" / "optimizer" / "rank0" / "stale.tensor.swp").exists()


def test_full_zero3_nvme_export_reloads_and_changes_the_output(full_nvme: TrainerRun, wider_tiny_base: Path) -> None:
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(full_nvme.artifact("diffusers_transformer"), torch_dtype=torch.float32)
    image = render(load_pipeline(wider_tiny_base, transformer=transformer))
    assert float(abs(image - base_image(wider_tiny_base)).max()) > 1e-4


def test_lora_over_an_nvme_offloaded_base_swaps_the_frozen_base_and_exports_a_loadable_adapter(
    libaio: None, wider_tiny_base: Path, tmp_path: Path
) -> None:
    run = nvme_job(tmp_path, wider_tiny_base, "lora", gradient_checkpointing=False).launch()

    assert_succeeded(run)
    assert run.metrics["nvme_swap_peak_bytes"]["params"] >= MIB
    image = render(lora_pipeline(wider_tiny_base, run.artifact("lora_diffusers")))
    assert float(abs(image - base_image(wider_tiny_base)).max()) > 1e-4


def test_lora_over_an_nvme_offloaded_base_with_gradient_checkpointing_is_refused_naming_the_deepspeed_bug(
    tiny_base: Path, tmp_path: Path
) -> None:
    run = nvme_job(tmp_path, tiny_base, "lora", gradient_checkpointing=True).launch()

    assert_refused(run, "invalid_config", "#3062", "offload_param 'cpu'", "gradient_checkpointing off")


# --------------------------------------------------------------------------------------------------
# Checkpoints and resume
# --------------------------------------------------------------------------------------------------
# A resumed run replays the uninterrupted one: the batch, noise and sigmas of a step are pure
# functions of (seed, step), and the checkpoint restores weights, fp32 master weights, Adam moments,
# the schedule and the step. One difference remains, measured here: DeepSpeedCPUAdam's C++ kernel
# keeps beta^t as a running float product during a run but recomputes it with pow() after a restart
# (csrc/includes/cpu_adam.h, IncrementStep), so the first resumed update can differ in the last bit
# of an fp32 master weight (measured: Adam moments bit-identical, master weights 1 fp32 ulp apart),
# which can flip the rounding of a bf16 weight. Later steps carry that on; Adam divides by sqrt(v),
# so for weights whose gradient is near zero it moves the update by a fraction of the learning rate.
# Measured after two resumed steps: full fine-tune within 1 bf16 ulp, LoRA within 0.03 x lr.
# Tolerance: one bf16 ulp, or a tenth of one step's learning rate.


def close_after_resume(a: torch.Tensor, b: torch.Tensor, learning_rate: float) -> bool:
    a, b = a.float(), b.float()
    larger = torch.maximum(a.abs(), b.abs())
    ulp = torch.pow(2.0, (torch.frexp(larger).exponent - 8).float())  # bf16 keeps 8 significant bits
    return bool(((a - b).abs() <= torch.clamp(ulp, min=0.1 * learning_rate)).all())


def resume_pair(tiny_base: Path, root: Path, training_type: str, **overrides: Any) -> tuple[TrainerRun, TrainerRun]:
    plan = make_plan(training_type=training_type)
    settings = {"steps": 4, "checkpointing_steps": 2, "lr_scheduler": "cosine", "lr_warmup_steps": 1, **overrides}
    if training_type == "lora":
        settings["export_formats"] = ("diffusers",)
    uninterrupted = new_job(root / "uninterrupted", tiny_base, plan=plan, **settings).launch()
    assert_succeeded(uninterrupted)
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]
    resumed = new_job(root / "resumed", tiny_base, plan=plan, resume_from=checkpoint, **settings).launch()
    assert_succeeded(resumed)
    return uninterrupted, resumed


@pytest.fixture(scope="module")
def full_resume(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    return resume_pair(tiny_base, tmp_path_factory.mktemp("full-resume"), "full")


@pytest.fixture(scope="module")
def lora_resume(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    return resume_pair(tiny_base, tmp_path_factory.mktemp("lora-resume"), "lora")


@pytest.mark.parametrize("pair_name", ["full_resume", "lora_resume"])
def test_resumed_run_continues_after_the_checkpoint_step(pair_name: str, request: pytest.FixtureRequest) -> None:
    uninterrupted, resumed = request.getfixturevalue(pair_name)
    assert [event["step"] for event in resumed.of_kind("step")] == [3, 4]
    assert resumed.metrics["resumed_from_step"] == 2
    first_resumed, first_replayed = resumed.of_kind("step")[0], uninterrupted.of_kind("step")[2]
    assert (first_resumed["loss"], first_resumed["lr"]) == (first_replayed["loss"], first_replayed["lr"])


@pytest.mark.parametrize("pair_name", ["full_resume", "lora_resume"])
def test_resumed_run_ends_with_the_uninterrupted_weights_within_float_tolerance(pair_name: str, request: pytest.FixtureRequest) -> None:
    uninterrupted, resumed = request.getfixturevalue(pair_name)
    kind = "diffusers_transformer" if pair_name == "full_resume" else "lora_diffusers"
    path_a, path_b = uninterrupted.artifact(kind), resumed.artifact(kind)
    if kind == "diffusers_transformer":
        path_a, path_b = path_a / "diffusion_pytorch_model.safetensors", path_b / "diffusion_pytorch_model.safetensors"
    a, b = load_file(path_a), load_file(path_b)
    assert a.keys() == b.keys()
    for name in a:
        assert close_after_resume(a[name], b[name], uninterrupted.config.learning_rate), name
    assert resumed.metrics["final_loss"] == pytest.approx(uninterrupted.metrics["final_loss"], rel=1e-3)


def test_resume_with_a_torch_optimizer_under_deepspeed_continues_the_schedule_the_trainer_steps(
    tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, resumed = resume_pair(tiny_base, tmp_path, "lora", optimizer="sgd")

    assert resumed.metrics["optimizer"] == "SGD"
    assert [event["step"] for event in resumed.of_kind("step")] == [3, 4]
    assert [event["lr"] for event in resumed.of_kind("step")] == pytest.approx(
        [event["lr"] for event in uninterrupted.of_kind("step")][2:]
    )
    a, b = load_file(uninterrupted.artifact("lora_diffusers")), load_file(resumed.artifact("lora_diffusers"))
    assert all(close_after_resume(a[name], b[name], uninterrupted.config.learning_rate) for name in a)


def test_lora_checkpoint_holds_only_the_adapter(lora_resume: tuple[TrainerRun, TrainerRun]) -> None:
    uninterrupted, _ = lora_resume
    (checkpoint,) = [Path(event["path"]) for event in uninterrupted.of_kind("checkpoint")]
    module_state = torch.load(checkpoint / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert module_state and all(".lora_" in name for name in module_state)


def test_checkpoint_event_names_a_complete_folder(full_resume: tuple[TrainerRun, TrainerRun]) -> None:
    uninterrupted, _ = full_resume
    (event,) = uninterrupted.of_kind("checkpoint")
    folder = Path(event["path"])
    assert (event["step"], folder.name) == (2, "checkpoint-2")
    assert read_json(folder / "fluxbooth_state.json")["step"] == 2
    assert not list(folder.parent.glob(".*partial"))


def test_resume_latest_picks_the_newest_checkpoint_in_the_checkpoint_folder(
    full_resume: tuple[TrainerRun, TrainerRun], tiny_base: Path, tmp_path: Path
) -> None:
    uninterrupted, _ = full_resume
    job = new_job(tmp_path / "job", tiny_base, steps=4, checkpointing_steps=2, lr_scheduler="cosine", lr_warmup_steps=1)
    shutil.copytree(uninterrupted.job_dir / "checkpoints", job.job_dir / "checkpoints")
    job.config = type(job.config)(**{**job.config.__dict__, "resume_from": "latest"})

    run = job.launch()

    assert_succeeded(run)
    assert [event["step"] for event in run.of_kind("step")] == [3, 4]


def test_resume_with_a_different_training_type_is_refused(full_resume: tuple[TrainerRun, TrainerRun], tiny_base: Path, tmp_path: Path) -> None:
    uninterrupted, _ = full_resume
    (checkpoint,) = [event["path"] for event in uninterrupted.of_kind("checkpoint")]
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(training_type="lora"), steps=4, resume_from=checkpoint).launch()

    assert run.returncode != 0
    (error,) = run.of_kind("error")
    assert error["code"] == "resume_failed"
    assert "training_type" in error["message"]


# --------------------------------------------------------------------------------------------------
# Prior preservation
# --------------------------------------------------------------------------------------------------


def test_prior_preservation_with_supplied_class_images_trains_on_both_sets(tiny_base: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "job", tiny_base, with_prior_preservation=True, num_class_images=2, class_dir=str(tmp_path / "job" / "class"))
    make_images(tmp_path / "job" / "class", 3, seed=5)

    run = job.launch()

    assert_succeeded(run)
    (ready,) = [event for event in run.of_kind("stage") if event.get("status") == "ready"]
    assert (ready["instance_images"], ready["class_images"]) == (3, 2)
    assert not (Path(job.config.cache_dir) / "class_images").exists()


@pytest.fixture(scope="module")
def generated_class_images(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, Path]:
    root = tmp_path_factory.mktemp("generated-class")
    shared_cache = root / "class-image-cache"
    run = new_job(root / "job", tiny_base, with_prior_preservation=True, num_class_images=2, class_image_cache_dir=str(shared_cache)).launch()
    assert_succeeded(run)
    return run, shared_cache


def test_prior_preservation_generates_missing_class_images_with_the_base_pipeline(
    generated_class_images: tuple[TrainerRun, Path],
) -> None:
    from PIL import Image

    run, shared_cache = generated_class_images
    (recipe_folder,) = shared_cache.iterdir()
    generated = sorted(recipe_folder.glob("*.png"))
    assert [path.name for path in generated] == ["class_00000.png", "class_00001.png"]
    assert Image.open(generated[0]).size == (64, 64)
    assert any(event.get("status") == "generating_class_images" for event in run.of_kind("stage"))
    (ready,) = [event for event in run.of_kind("stage") if event.get("status") == "ready"]
    assert ready["class_images"] == 2


def test_generated_class_images_are_reused_by_the_next_job_with_the_same_recipe(
    generated_class_images: tuple[TrainerRun, Path], tiny_base: Path, tmp_path: Path
) -> None:
    _, shared_cache = generated_class_images
    (recipe_folder,) = shared_cache.iterdir()
    before = {path.name: path.stat().st_mtime_ns for path in recipe_folder.iterdir()}

    run = new_job(tmp_path / "job", tiny_base, with_prior_preservation=True, num_class_images=2, class_image_cache_dir=str(shared_cache)).launch()

    assert_succeeded(run)
    assert not any(event.get("status") == "generating_class_images" for event in run.of_kind("stage"))
    assert {path.name: path.stat().st_mtime_ns for path in recipe_folder.iterdir()} == before


def test_prior_loss_weight_changes_the_loss(tiny_base: Path, tmp_path: Path) -> None:
    losses = {}
    for weight in (0.0, 1.0):
        job = new_job(tmp_path / f"w{weight}", tiny_base, steps=1, with_prior_preservation=True, num_class_images=1,
                      prior_loss_weight=weight, class_dir=str(tmp_path / "class"))
        make_images(tmp_path / "class", 1, seed=9)
        run = job.launch()
        assert_succeeded(run)
        losses[weight] = run.of_kind("step")[0]["loss"]
    assert losses[1.0] > losses[0.0]


# --------------------------------------------------------------------------------------------------
# Several processes: two on one machine, and two single-process "machines" on localhost
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_processes_zero2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = new_job(tmp_path_factory.mktemp("two-processes"), tiny_base, plan=make_plan(num_processes=2), steps=2).launch()
    assert_succeeded(run)
    return run


def test_two_processes_train_as_one_job_of_world_size_two(two_processes_zero2: TrainerRun) -> None:
    assert two_processes_zero2.metrics["num_processes"] == 2
    assert [event["step"] for event in two_processes_zero2.of_kind("step")] == [1, 2]
    assert len(two_processes_zero2.of_kind("done")) == 1


def test_two_processes_export_weights_shaped_like_the_base(two_processes_zero2: TrainerRun, tiny_base: Path) -> None:
    trained = transformer_state(two_processes_zero2.artifact("diffusers_transformer"))
    base = transformer_state(tiny_base / "transformer")
    assert {name: tensor.shape for name, tensor in trained.items()} == {name: tensor.shape for name, tensor in base.items()}


def test_two_machines_on_localhost_train_the_same_job_as_two_local_processes(
    two_processes_zero2: TrainerRun, tiny_base: Path, tmp_path: Path
) -> None:
    main_node, other_node = new_job(tmp_path / "job", tiny_base, plan=make_plan(num_processes=2), steps=2).launch_as_nodes(2)

    assert (main_node.returncode, other_node.returncode) == (0, 0), main_node.log[-3000:] + other_node.log[-3000:]
    assert main_node.metrics["num_processes"] == 2
    assert other_node.events == []  # only the global main process reports
    # Same world size, seed and data order: the same losses, step for step.
    assert [event["loss"] for event in main_node.of_kind("step")] == pytest.approx(
        [event["loss"] for event in two_processes_zero2.of_kind("step")], rel=1e-5
    )
    trained = transformer_state(main_node.artifact("diffusers_transformer"))
    reference = transformer_state(two_processes_zero2.artifact("diffusers_transformer"))
    assert {name: tensor.shape for name, tensor in trained.items()} == {name: tensor.shape for name, tensor in reference.items()}


def test_two_processes_lora_under_zero3_export_a_loadable_adapter(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu", num_processes=2)
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2).launch()

    assert_succeeded(run)
    assert run.metrics["num_processes"] == 2
    image = render(lora_pipeline(tiny_base, run.artifact("lora_diffusers")))
    assert float(abs(image - base_image(tiny_base)).max()) > 1e-4


def test_two_processes_without_deepspeed_train_as_one_data_parallel_group(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(use_deepspeed=False, num_processes=2)
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2, optimizer="adamw").launch()

    assert_succeeded(run)
    assert (run.metrics["num_processes"], run.metrics["zero_stage"], run.metrics["optimizer"]) == (2, 0, "AdamW")
    trained, base = transformer_state(run.artifact("diffusers_transformer")), transformer_state(tiny_base / "transformer")
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[name], base[name]) for name in base)


# --------------------------------------------------------------------------------------------------
# Learning: over-fitting one image
# --------------------------------------------------------------------------------------------------
# Step losses are too noisy to compare (each step draws its own sigma and noise), so the trainer
# also reports the loss at fixed noise and sigmas 0.25/0.5/0.75 before and after training.
# Measured (tiny model, one 64x64 image, seed 7, full ZeRO-2, lr 1e-3): 1.419 -> 1.012 after 40 steps
# (ratio 0.71), 1.004 after 60. The threshold leaves room for library and CPU differences.
OVERFIT_LOSS_RATIO = 0.8


def test_overfitting_one_image_lowers_the_fixed_noise_loss_clearly(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, images=1, steps=40, learning_rate=1e-3).launch()

    assert_succeeded(run)
    fixed = run.metrics["fixed_noise_loss"]
    assert fixed["end"] < OVERFIT_LOSS_RATIO * fixed["start"], fixed
    step_losses = [event["loss"] for event in run.of_kind("step")]
    assert sum(step_losses[-10:]) < sum(step_losses[:10])


# --------------------------------------------------------------------------------------------------
# EMA and validation images
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_with_ema_and_validation(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora")
    job = new_job(
        tmp_path_factory.mktemp("ema"), tiny_base, plan=plan, steps=3, ema_decay=0.5,
        validation_prompts=("a photo of sks dog", "a sks dog in the snow"), export_formats=LORA_FORMATS,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def test_ema_lora_is_exported_beside_the_trained_lora_in_every_format(lora_with_ema_and_validation: TrainerRun) -> None:
    ema = load_file(lora_with_ema_and_validation.artifact("ema_lora_diffusers"))
    trained = load_file(lora_with_ema_and_validation.artifact("lora_diffusers"))
    assert ema.keys() == trained.keys()
    assert lora_with_ema_and_validation.artifact("ema_lora_comfyui").is_file()


def test_ema_lora_averages_towards_the_start(lora_with_ema_and_validation: TrainerRun) -> None:
    # LoRA B starts at zero, so an average over the run is smaller than where the run ended.
    ema = load_file(lora_with_ema_and_validation.artifact("ema_lora_diffusers"))
    trained = load_file(lora_with_ema_and_validation.artifact("lora_diffusers"))
    b_keys = [key for key in trained if key.endswith("lora_B.weight")]
    ema_norm = sum(float(ema[key].float().norm()) for key in b_keys)
    trained_norm = sum(float(trained[key].float().norm()) for key in b_keys)
    assert 0 < ema_norm < trained_norm


def test_ema_lora_loads_in_diffusers(lora_with_ema_and_validation: TrainerRun, tiny_base: Path) -> None:
    image = render(lora_pipeline(tiny_base, lora_with_ema_and_validation.artifact("ema_lora_diffusers")))
    assert image.shape == (64, 64, 3)


def test_validation_images_are_rendered_for_each_prompt_with_their_seed(lora_with_ema_and_validation: TrainerRun) -> None:
    from PIL import Image

    index = read_json(lora_with_ema_and_validation.artifact("validation_index"))
    assert [record["prompt"] for record in index["images"]] == ["a photo of sks dog", "a sks dog in the snow"]
    assert all(isinstance(record["seed"], int) for record in index["images"])
    images = [entry for entry in lora_with_ema_and_validation.done["artifacts"] if entry["kind"] == "validation_image"]
    assert [Path(entry["path"]).name for entry in images] == [record["file"] for record in index["images"]]
    for entry in images:
        with Image.open(lora_with_ema_and_validation.output_dir / entry["path"]) as image:
            assert (image.format, image.size) == ("PNG", (64, 64))


def test_full_zero3_with_ema_exports_an_ema_transformer(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2, ema_decay=0.5).launch()

    assert_succeeded(run)
    ema, trained = transformer_state(run.artifact("ema_diffusers_transformer")), transformer_state(run.artifact("diffusers_transformer"))
    assert ema.keys() == trained.keys()
    assert any(not torch.equal(ema[name], trained[name]) for name in trained)


VALIDATION_PROMPTS = ("a photo of sks dog", "a sks dog in the snow")


def validation_job(root: Path, tiny_base: Path, plan: Any, **overrides: Any) -> Any:
    settings = {"steps": 5, "validation_prompts": VALIDATION_PROMPTS, "export_formats": ("diffusers",), **overrides}
    return new_job(root, tiny_base, plan=plan, **settings)


def validation_pixels(run: TrainerRun, file: str) -> Any:
    import numpy
    from PIL import Image

    with Image.open(run.output_dir / "validation" / file) as image:
        assert (image.format, image.size) == ("PNG", (64, 64))
        return numpy.asarray(image, dtype=numpy.int16)


def records_at(run: TrainerRun, training_step: int) -> list[dict[str, Any]]:
    index = read_json(run.artifact("validation_index"))
    return [record for record in index["images"] if record["training_step"] == training_step]


@pytest.fixture(scope="module")
def lora_validation_every_2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = validation_job(tmp_path_factory.mktemp("validation-steps"), tiny_base, make_plan(training_type="lora"), validation_steps=2).launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def lora_4_steps_without_validation_steps(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = validation_job(tmp_path_factory.mktemp("validation-end"), tiny_base, make_plan(training_type="lora"), steps=4).launch()
    assert_succeeded(run)
    return run


def test_validation_steps_render_every_prompt_at_every_nth_step_and_at_the_end(lora_validation_every_2: TrainerRun) -> None:
    index = read_json(lora_validation_every_2.artifact("validation_index"))
    assert [(record["training_step"], record["prompt"], record["file"]) for record in index["images"]] == [
        (2, VALIDATION_PROMPTS[0], "step-000002/validation_00.png"),
        (2, VALIDATION_PROMPTS[1], "step-000002/validation_01.png"),
        (4, VALIDATION_PROMPTS[0], "step-000004/validation_00.png"),
        (4, VALIDATION_PROMPTS[1], "step-000004/validation_01.png"),
        (5, VALIDATION_PROMPTS[0], "validation_00.png"),
        (5, VALIDATION_PROMPTS[1], "validation_01.png"),
    ]
    for record in index["images"]:
        validation_pixels(lora_validation_every_2, record["file"])


def test_validation_images_of_every_step_are_uploadable_artifacts_with_unique_names(lora_validation_every_2: TrainerRun) -> None:
    images = [entry for entry in lora_validation_every_2.done["artifacts"] if entry["kind"] == "validation_image"]
    index = read_json(lora_validation_every_2.artifact("validation_index"))
    assert [entry["path"] for entry in images] == [f"validation/{record['file']}" for record in index["images"]]
    assert [entry["name"] for entry in images] == [
        "validation_step000002_00", "validation_step000002_01", "validation_step000004_00", "validation_step000004_01",
        "validation_00", "validation_01",
    ]


def test_validation_images_keep_one_seed_per_prompt_across_steps(lora_validation_every_2: TrainerRun) -> None:
    seeds = [[record["seed"] for record in records_at(lora_validation_every_2, step)] for step in (2, 4, 5)]
    assert seeds[0] == seeds[1] == seeds[2]
    assert len(set(seeds[0])) == 2


def test_validation_images_change_as_training_goes_on(lora_validation_every_2: TrainerRun) -> None:
    early = validation_pixels(lora_validation_every_2, "step-000002/validation_00.png")
    later = validation_pixels(lora_validation_every_2, "step-000004/validation_00.png")
    final = validation_pixels(lora_validation_every_2, "validation_00.png")
    # The tiny model renders near-grey noise; a few steps of LoRA move many pixels by a level or two.
    assert (early != final).mean() > 0.1
    assert (early != later).mean() > 0.1


def test_validation_during_training_is_a_validate_stage_between_steps(lora_validation_every_2: TrainerRun) -> None:
    sequence = [
        (event["event"], event.get("step"))
        for event in lora_validation_every_2.events
        if event["event"] == "step" or (event["event"] == "stage" and event["stage"] == "validate")
    ]
    assert sequence == [("step", 1), ("step", 2), ("stage", 2), ("step", 3), ("step", 4), ("stage", 4), ("step", 5), ("stage", None)]


def test_validation_during_training_leaves_the_training_itself_unchanged(
    lora_validation_every_2: TrainerRun, lora_4_steps_without_validation_steps: TrainerRun
) -> None:
    with_renders = [event["loss"] for event in lora_validation_every_2.of_kind("step")]
    without = [event["loss"] for event in lora_4_steps_without_validation_steps.of_kind("step")]
    assert with_renders[:4] == without


def test_validation_during_training_renders_what_the_exported_weights_render(
    lora_validation_every_2: TrainerRun, lora_4_steps_without_validation_steps: TrainerRun
) -> None:
    # The same first 4 steps, rendered once from the engine (cached embeddings, no text encoders) and once
    # from the exported LoRA in a fresh pipeline: the series across steps and the final image compare.
    during = validation_pixels(lora_validation_every_2, "step-000004/validation_01.png")
    exported = validation_pixels(lora_4_steps_without_validation_steps, "validation_01.png")
    earlier = validation_pixels(lora_validation_every_2, "step-000002/validation_01.png")
    assert (during != exported).mean() < 0.01  # measured: pixel-identical on the CPU
    assert (earlier != exported).mean() > 0.1


def test_full_zero3_renders_validation_images_during_training(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    run = validation_job(tmp_path / "job", tiny_base, plan, validation_steps=2).launch()

    assert_succeeded(run)
    assert [record["training_step"] for record in read_json(run.artifact("validation_index"))["images"]] == [2, 2, 4, 4, 5, 5]
    early, final = validation_pixels(run, "step-000002/validation_00.png"), validation_pixels(run, "validation_00.png")
    assert (early != final).mean() > 0.1


def test_two_processes_lora_under_zero3_render_validation_images_during_training(tiny_base: Path, tmp_path: Path) -> None:
    # Every rank runs the forward (each holds a slice of every layer); only the main process writes.
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu", num_processes=2)
    run = validation_job(tmp_path / "job", tiny_base, plan, steps=3, validation_steps=2).launch()

    assert_succeeded(run)
    assert [record["training_step"] for record in read_json(run.artifact("validation_index"))["images"]] == [2, 2, 3, 3]
    early, final = validation_pixels(run, "step-000002/validation_00.png"), validation_pixels(run, "validation_00.png")
    assert (early != final).mean() > 0.1


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
# configs.py writes for each name: DeepSpeed's CPU kernels for its block types (the first run builds each CPU op:
# minutes), the torch optimizer itself for the others. adamw and sgd run in the warm-up tests below; adam is
# adamw's kernel with adam_w_mode off (tests/test_configs.py).
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


def test_cosine_without_warmup_under_deepspeed_starts_at_the_full_learning_rate(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, steps=3, lr_scheduler="cosine", lr_warmup_steps=0).launch()

    assert_succeeded(run)
    rates = [event["lr"] for event in run.of_kind("step")]
    assert rates == pytest.approx([1e-4, 0.75e-4, 0.25e-4])


def test_cosine_schedule_decays_the_learning_rate(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(use_deepspeed=False), steps=3, lr_scheduler="cosine", lr_warmup_steps=1).launch()

    assert_succeeded(run)
    rates = [event["lr"] for event in run.of_kind("step")]
    assert rates == pytest.approx([0.5e-4, 1e-4, 0.5e-4])


def assert_refused(run: TrainerRun, code: str, *fragments: str) -> None:
    assert run.returncode != 0
    (error,) = run.of_kind("error")
    assert error["code"] == code, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    assert not run.of_kind("step")


def test_unknown_optimizer_is_refused_with_the_supported_names(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(tmp_path / "job", tiny_base, plan=make_plan(use_deepspeed=False), optimizer="prodigy").launch()
    assert_refused(run, "invalid_config", "'prodigy'", "adamw", "adafactor", "lion")


def launch_with_deepspeed_json(job: TrainerJob, edit: Any) -> TrainerRun:
    """Launch `job` with the DeepSpeed JSON configs.py writes, changed by `edit` (a hand-written JSON)."""
    files = job.write()
    deepspeed_json = read_json(files.deepspeed_config)
    edit(deepspeed_json)
    files.deepspeed_config.write_text(json.dumps(deepspeed_json))
    job.write = lambda: files  # type: ignore[method-assign]  # launch the edited files as they are
    return job.launch()


def test_optimizer_that_disagrees_with_the_deepspeed_json_is_refused_not_swapped(tiny_base: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "job", tiny_base, optimizer="adafactor")
    run = launch_with_deepspeed_json(job, lambda ds: ds.update(optimizer={"type": "AdamW", "params": {"lr": 1e-4}}))
    assert_refused(run, "invalid_config", "'adafactor'", "'AdamW'")


def test_torch_optimizer_that_accelerate_would_swap_for_deepspeed_cpu_adam_is_refused(tiny_base: Path, tmp_path: Path) -> None:
    job = new_job(tmp_path / "job", tiny_base, optimizer="sgd")
    run = launch_with_deepspeed_json(job, lambda ds: ds.pop("zero_force_ds_cpu_optimizer"))
    assert_refused(run, "invalid_config", "'sgd'", '"zero_force_ds_cpu_optimizer": false', "DeepSpeedCPUAdam")


def test_nvme_offload_without_a_way_to_build_the_async_io_op_is_reported_as_missing_libaio(
    tiny_base: Path, tmp_path: Path
) -> None:
    plan = replace(make_plan(zero_stage=3, offload_param="nvme", offload_optimizer="nvme"), nvme_path=str(tmp_path / "swap"))
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
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
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
    "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False},
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

    from fluxbooth.events import parse_event

    job = new_job(tmp_path / "job", tiny_base, plan=make_plan(zero_stage=3, offload_param="cpu"), steps=2, gradient_accumulation_steps=2)
    files = job.write()
    ds_file = tmp_path / "ds_z3_cpuoffload.json"
    ds_file.write_text(json.dumps(DIFFSYNTH_ZERO3_OFFLOAD))
    accelerate_file = tmp_path / "deepspeed_zero3_cpuoffload.yaml"
    accelerate_file.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "debug": True, "distributed_type": "DEEPSPEED", "downcast_bf16": "no",
        "deepspeed_config": {"deepspeed_config_file": str(ds_file), "zero3_init_flag": True},
        "enable_cpu_affinity": False, "machine_rank": 0, "main_training_function": "main", "num_machines": 1,
        "num_processes": 1, "rdzv_backend": "static", "same_network": True, "tpu_env": [], "tpu_use_cluster": False,
        "tpu_use_sudo": False, "use_cpu": False,
    }))
    completed = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_file),
         "-m", "fluxbooth.train", "--config", str(files.trainer_config)],
        env=job.environment(), capture_output=True, text=True, timeout=600,
    )
    events = [event for line in completed.stdout.splitlines() if (event := parse_event(line))]

    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-4000:]
    (done,) = [event for event in events if event["event"] == "done"]
    assert (done["metrics"]["zero_stage"], done["metrics"]["transformer_loading"]["method"]) == (3, "zero3_init")
    # No optimizer block: the trainer's torch AdamW, which accelerate swaps for DeepSpeedCPUAdam when offloading.
    assert done["metrics"]["optimizer"] == "DeepSpeedCPUAdam"
    assert [event["step"] for event in events if event["event"] == "step"] == [1, 2]


