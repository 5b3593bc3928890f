"""plan.py and sizing/: sizing FLUX without weights, predicting memory, choosing or refusing.

Sizes are checked against the real diffusers/transformers/peft classes built on the meta device
(no weights, no download); choices against issue 5's "done when" list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.trainer_config import LoraSettings
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.messages import format_bytes
from fluxbooth.plan import (
    JobShape,
    Strategy,
    activation_bytes,
    as_job,
    choose_plan,
    estimate_memory,
    evaluate_candidates,
    full_finetune_host_bytes,
    optimizer_for,
    pick,
    strategies_for,
)
from fluxbooth.plan.gpus import GPU_TABLE, gpu_spec
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec
from fluxbooth.sizing import FLUX_DEV_NAME, FLUX_SCHNELL_NAME, ModelSize, model_size, model_size_from_configs
from fluxbooth.sizing.flux1 import _CLIP_L_CONFIG, _FLUX_TRANSFORMER_CONFIG, _FLUX_VAE_CONFIG, _T5_XXL_CONFIG
from tests.conftest import REPO_ROOT
from tests.support.specs import gpu_machine, job_spec

# ---- factories ------------------------------------------------------------------------------------


def request_spec(model: ModelSize | None = None, **fields: Any) -> JobSpec:
    """A full fine-tune at 1024x1024 naming its optimizer (adamw), with request `fields` (a (width, height)
    resolution a fixed shape), resolved for `model` (FLUX.1-dev unless given) as the worker resolves it."""
    resolution = fields.pop("resolution", (1024, 1024))
    return job_spec(
        parse_request(
            {
                "model_name": "m",
                "dataset_url": "https://example.com/d.zip",
                "instance_prompt": "a photo of sks person",
                "training_type": "full",
                "optimizer": "adamw",
                "resolution": f"{resolution[0]}x{resolution[1]}",
                **fields,
            }
        ),
        model,
    )


def cpu_machine(host_gib: float = 24) -> Hardware:
    return hypothetical_hardware(
        gpus=0, gpu_memory_bytes=0, host_memory_bytes=int(host_gib * GIB), disk_bytes=100 * GIB
    )


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fluxbooth.synthetic.tiny import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "tiny-flux")


def write_flux_folder(folder: Path, transformer: dict, clip: dict, t5: dict, vae: dict) -> Path:
    for name, config in (("transformer", transformer), ("text_encoder", clip), ("text_encoder_2", t5), ("vae", vae)):
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "config.json").write_text(json.dumps(config))
    return folder


def count_on_meta(transformer: dict, clip: dict, t5: dict, vae: dict) -> tuple[int, int, int, int, int]:
    """(transformer, largest layer, CLIP, T5, VAE) parameters of the real classes, no weights."""
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device("meta"):
        flux = FluxTransformer2DModel(**transformer)
        clip_model = CLIPTextModel(CLIPTextConfig(**clip))
        t5_model = T5EncoderModel(T5Config(**t5, is_encoder_decoder=False, use_cache=False))
        vae_model = AutoencoderKL(
            **vae,
            down_block_types=["DownEncoderBlock2D"] * len(vae["block_out_channels"]),
            up_block_types=["UpDecoderBlock2D"] * len(vae["block_out_channels"]),
        )
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in flux.modules())
    return (
        sum(p.numel() for p in flux.parameters()),
        largest,
        sum(p.numel() for p in clip_model.parameters()),
        sum(p.numel() for p in t5_model.parameters()),
        sum(p.numel() for p in vae_model.parameters()),
    )


# ---- model sizing ---------------------------------------------------------------------------------


def test_flux_dev_preset_has_the_published_sizes() -> None:
    size = model_size(FLUX_DEV_NAME)
    assert size.transformer_params == 11_901_408_320
    assert size.text_encoder_params == 123_060_480
    assert size.text_encoder_2_params == 4_762_310_656
    assert size.vae_params == 83_819_683
    # The norm1.linear of a double block, which ZeRO-3 gathers whole.
    assert size.largest_layer_params == 56_641_536


def test_flux_presets_match_the_real_classes_on_the_meta_device() -> None:
    for name, guidance in ((FLUX_DEV_NAME, True), (FLUX_SCHNELL_NAME, False)):
        transformer = {**_FLUX_TRANSFORMER_CONFIG, "guidance_embeds": guidance}
        vae = {key: value for key, value in _FLUX_VAE_CONFIG.items() if key != "mid_block_add_attention"}
        size = model_size(name)
        assert (
            size.transformer_params,
            size.largest_layer_params,
            size.text_encoder_params,
            size.text_encoder_2_params,
            size.vae_params,
        ) == count_on_meta(transformer, _CLIP_L_CONFIG, _T5_XXL_CONFIG, vae)


def test_a_local_folder_of_another_shape_is_sized_from_its_configs(tmp_path: Path) -> None:
    transformer = {
        **_FLUX_TRANSFORMER_CONFIG,
        "num_layers": 3,
        "num_single_layers": 5,
        "num_attention_heads": 3,
        "attention_head_dim": 64,
        "joint_attention_dim": 256,
        "pooled_projection_dim": 96,
        "in_channels": 16,
        "guidance_embeds": False,
        "axes_dims_rope": [16, 24, 24],
    }
    clip = {
        **_CLIP_L_CONFIG,
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "vocab_size": 1000,
    }
    t5 = {
        **_T5_XXL_CONFIG,
        "d_model": 256,
        "d_kv": 32,
        "d_ff": 300,
        "num_layers": 3,
        "num_heads": 8,
        "vocab_size": 900,
        "feed_forward_proj": "relu",
    }
    vae = {
        "in_channels": 3,
        "out_channels": 3,
        "block_out_channels": [32, 64],
        "layers_per_block": 1,
        "latent_channels": 4,
        "norm_num_groups": 16,
    }
    size = model_size(str(write_flux_folder(tmp_path / "custom", transformer, clip, t5, vae)))
    assert size.source == "config"
    assert (
        size.transformer_params,
        size.largest_layer_params,
        size.text_encoder_params,
        size.text_encoder_2_params,
        size.vae_params,
    ) == count_on_meta(transformer, clip, t5, vae)


def test_the_tiny_model_folder_is_sized_exactly(tiny_model_dir: Path) -> None:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    size = model_size(str(tiny_model_dir))
    assert (
        size.transformer_params
        == FluxTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer").num_parameters()
    )
    assert size.text_encoder_params == CLIPTextModel.from_pretrained(tiny_model_dir / "text_encoder").num_parameters()
    assert (
        size.text_encoder_2_params == T5EncoderModel.from_pretrained(tiny_model_dir / "text_encoder_2").num_parameters()
    )
    assert size.vae_params == sum(
        p.numel() for p in AutoencoderKL.from_pretrained(tiny_model_dir, subfolder="vae").parameters()
    )


def test_lora_parameter_count_matches_peft(tiny_model_dir: Path) -> None:
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    size = model_size(str(tiny_model_dir))
    for rank, targets in ((4, LoraSettings().target_modules), (8, ("to_q", "to_v")), (2, ("proj_out",))):
        model = FluxTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
        model = inject_adapter_in_model(LoraConfig(r=rank, target_modules=list(targets)), model)
        peft_count = sum(tensor.numel() for tensor in get_peft_model_state_dict(model).values())
        assert size.lora_params(rank, targets) == peft_count


def test_an_unknown_name_is_refused_before_any_download() -> None:
    with pytest.raises(FluxboothError) as caught:
        model_size("someone/some-model")
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert "'someone/some-model'" in caught.value.message


def test_a_folder_without_a_flux_transformer_is_refused(tmp_path: Path) -> None:
    (tmp_path / "sdxl" / "unet").mkdir(parents=True)
    (tmp_path / "sdxl" / "transformer").mkdir()
    (tmp_path / "sdxl" / "transformer" / "config.json").write_text('{"num_layers": 24}')
    with pytest.raises(FluxboothError) as caught:
        model_size(str(tmp_path / "sdxl"))
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert "not a FLUX transformer" in caught.value.message


# ---- issue 5, "done when" -------------------------------------------------------------------------


def test_full_flux_dev_at_1024_on_8_gib_and_48_gib_host_is_refused_with_a_lora_alternative() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(request_spec(resolution=(1024, 1024)), gpu_machine(8, 48), model_size(FLUX_DEV_NAME))
    error = caught.value
    assert error.code is ErrorCode.DOES_NOT_FIT
    assert "host RAM" in error.message and "48.0 GiB" in error.message
    assert "Would fit: LoRA rank 16" in error.message
    assert error.details["alternatives"][0]["training_type"] == "lora"


def test_the_same_job_on_80_gib_and_320_gib_host_gets_a_plan() -> None:
    plan = choose_plan(request_spec(), gpu_machine(80, 320), model_size(FLUX_DEV_NAME))
    assert plan.accelerator == "cuda"
    assert plan.training_type == "full"
    assert plan.predicted_gpu_bytes * 1.1 <= 80 * GIB
    assert plan.predicted_host_bytes * 1.1 <= 320 * GIB


def test_zero2_with_cpu_offload_never_predicts_less_gpu_than_the_bf16_weights() -> None:
    model = model_size(FLUX_DEV_NAME)
    strategy = Strategy("full", True, 2, "cpu", "none")
    for resolution in ((512, 512), (1024, 1024)):
        for checkpointing in (True, False):
            job = JobShape(resolution=resolution, gradient_checkpointing=checkpointing)
            estimate = estimate_memory(strategy, model, job, gpu_machine(80, 512), "bf16")
            assert estimate.gpu_bytes >= model.transformer_params * 2 >= 22 * GIB


# ---- choices ---------------------------------------------------------------------------------------


def test_the_tiny_model_on_cpu_gets_zero2_with_cpu_adam(tiny_model_dir: Path) -> None:
    plan = choose_plan(
        request_spec(model_size(str(tiny_model_dir)), resolution=(64, 64)),
        cpu_machine(),
        model_size(str(tiny_model_dir)),
    )
    assert (plan.accelerator, plan.num_processes) == ("cpu", 1)
    assert (plan.use_deepspeed, plan.zero_stage, plan.offload_optimizer, plan.offload_param) == (True, 2, "cpu", "none")
    assert plan.optimizer == "DeepSpeedCPUAdam"
    assert plan.predicted_gpu_bytes == 0
    assert plan.predicted_host_bytes > 0


def test_without_deepspeed_the_plan_is_stage_0_without_offload(tiny_model_dir: Path) -> None:
    plan = choose_plan(
        request_spec(model_size(str(tiny_model_dir)), resolution=(64, 64), use_deepspeed=False),
        cpu_machine(),
        model_size(str(tiny_model_dir)),
    )
    assert (plan.use_deepspeed, plan.zero_stage, plan.offload_optimizer, plan.offload_param) == (
        False,
        0,
        "none",
        "none",
    )


def test_flux_dev_on_a_cpu_only_machine_is_refused_naming_the_missing_gpu_and_host_ram() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(request_spec(), cpu_machine(24), model_size(FLUX_DEV_NAME))
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "no GPU" in caught.value.message
    assert "24.0 GiB available" in caught.value.message


def test_the_real_training_request_is_accepted(tiny_model_dir: Path) -> None:
    from fluxbooth.request.model import parse_request

    request = parse_request(
        {
            "model_name": "m",
            "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
            "instance_prompt": "a sks dog",
            "resolution": "64x64",
            "training_type": "lora",
            "lora_rank": 4,
        }
    )
    model = model_size(str(tiny_model_dir))
    plan = choose_plan(job_spec(request, model), cpu_machine(), model)
    assert plan.training_type == "lora"
    assert plan.zero_stage == 2


def test_a_requested_zero_stage_is_honoured_when_it_fits() -> None:
    plan = choose_plan(request_spec(zero_stage=3), gpu_machine(80, 320), model_size(FLUX_DEV_NAME))
    assert plan.zero_stage == 3


def test_a_requested_offload_that_does_not_fit_is_refused_not_overridden() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(request_spec(training_type="lora", offload="none"), gpu_machine(8, 64), model_size(FLUX_DEV_NAME))
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "per GPU + 10 % headroom, has 8.0 GiB" in caught.value.message


def test_nvme_offload_without_an_offload_path_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(request_spec(offload="nvme"), gpu_machine(80, 256), model_size(FLUX_DEV_NAME))
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "FLUXBOOTH_NVME_PATH" in caught.value.message


@pytest.mark.parametrize(
    ("optimizer", "offload", "expected"),
    [
        ("adamw", "cpu", "DeepSpeedCPUAdam"),
        ("Adagrad", "cpu", "DeepSpeedCPUAdagrad"),
        ("lion", "nvme", "DeepSpeedCPULion"),
        ("sgd", "cpu", "SGD"),
        ("adamw", "none", "AdamW"),
        ("lion", "none", "Lion"),
    ],
)
def test_the_plan_names_the_optimizer_class_that_will_step(optimizer: str, offload: str, expected: str) -> None:
    strategy = Strategy("full", True, 3, offload, "none")  # type: ignore[arg-type]
    assert optimizer_for(strategy, optimizer) == expected


def test_optimizers_with_less_state_than_adam_are_predicted_to_need_less_host_memory() -> None:
    machine = gpu_machine(80, 512)
    adam = choose_plan(request_spec(zero_stage=2, offload="cpu"), machine, model_size(FLUX_DEV_NAME))
    sgd = choose_plan(request_spec(zero_stage=2, offload="cpu", optimizer="sgd"), machine, model_size(FLUX_DEV_NAME))
    # One fp32 state buffer fewer per trainable parameter: 4 bytes x 11.9 B parameters.
    assert adam.predicted_host_bytes - sgd.predicted_host_bytes == 4 * 11_901_408_320


def test_only_full_fine_tunes_consider_parameters_on_nvme() -> None:
    def layouts(training_type: str) -> set[tuple[int, str, str]]:
        return {(s.zero_stage, s.offload_optimizer, s.offload_param) for s in strategies_for(training_type, True, True)}

    assert (3, "nvme", "nvme") in layouts("full")
    assert (3, "nvme", "nvme") not in layouts("lora")
    assert (3, "nvme", "cpu") in layouts("lora")


def test_lora_over_a_bf16_base_on_an_8_gib_card_streams_the_frozen_blocks_from_host_ram() -> None:
    plan = choose_plan(
        request_spec(training_type="lora", base_precision="bf16"), gpu_machine(8, 64), model_size(FLUX_DEV_NAME)
    )
    assert (plan.zero_stage, plan.offload_param, plan.block_swap) == (2, "none", True)
    assert plan.cache_encoders_on_cpu


def test_lora_over_a_bf16_base_on_an_8_gib_card_with_offload_none_keeps_it_on_the_gpu_and_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(
            request_spec(training_type="lora", base_precision="bf16", offload="none"),
            gpu_machine(8, 64),
            model_size(FLUX_DEV_NAME),
        )
    assert caught.value.code is ErrorCode.DOES_NOT_FIT


def test_a_big_card_trains_lora_without_offload() -> None:
    plan = choose_plan(request_spec(training_type="lora"), gpu_machine(80, 256), model_size(FLUX_DEV_NAME))
    assert (plan.zero_stage, plan.offload_optimizer, plan.offload_param) == (2, "none", "none")


def test_fp16_on_the_cpu_accelerator_becomes_bf16_with_a_warning(tiny_model_dir: Path) -> None:
    plan = choose_plan(
        request_spec(model_size(str(tiny_model_dir)), resolution=(64, 64), mixed_precision="fp16"),
        cpu_machine(),
        model_size(str(tiny_model_dir)),
    )
    assert plan.mixed_precision == "bf16"
    assert any("fp16" in warning for warning in plan.warnings)


def test_a_run_far_beyond_the_deadline_is_refused_with_the_affordable_steps() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(request_spec(steps=100_000), gpu_machine(80, 320), model_size(FLUX_DEV_NAME), deadline_seconds=3600)
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "beyond the job deadline" in caught.value.message
    assert "use about" in caught.value.message


def test_a_run_close_to_the_deadline_is_warned() -> None:
    model = model_size(FLUX_DEV_NAME)
    hardware = gpu_machine(80, 320)
    # Without validation renders: scoring them would shrink to fit the deadline rather than bring it close.
    spec = request_spec(steps=100, validation_prompts=[])
    total = choose_plan(spec, hardware, model).predicted_total_seconds
    plan = choose_plan(spec, hardware, model, deadline_seconds=total / 0.9)
    assert any("close to the job deadline" in warning for warning in plan.warnings)


def test_every_candidate_reports_the_contract_fields() -> None:
    candidates = evaluate_candidates(request_spec(), gpu_machine(8, 64), model_size(FLUX_DEV_NAME))
    for candidate in candidates:
        data = candidate.to_dict()
        for key in (
            "zero_stage",
            "offload_optimizer",
            "offload_param",
            "training_type",
            "fits",
            "gpu_bytes",
            "host_bytes",
            "disk_bytes",
            "reason",
        ):
            assert key in data


# ---- the memory model's parts ------------------------------------------------------------------------


def test_activations_grow_with_resolution_and_shrink_with_checkpointing() -> None:
    model = model_size(FLUX_DEV_NAME)
    small = sum(activation_bytes(model, JobShape(resolution=(512, 512)), "bf16", 1).values())
    large = sum(activation_bytes(model, JobShape(resolution=(1024, 1024)), "bf16", 1).values())
    every_second = sum(activation_bytes(model, JobShape(), "bf16", 2).values())
    unchecked = sum(activation_bytes(model, JobShape(), "bf16", 0).values())
    assert small < large < every_second < unchecked


def test_prior_preservation_doubles_the_activation_batch() -> None:
    model = model_size(FLUX_DEV_NAME)
    single = activation_bytes(model, JobShape(), "bf16")["activations_working"]
    doubled = activation_bytes(model, JobShape(with_prior_preservation=True), "bf16")["activations_working"]
    assert doubled == pytest.approx(2 * single, abs=1)


def test_a_request_without_lora_targets_is_planned_for_the_parameters_the_trainer_trains(tiny_model_dir: Path) -> None:
    from diffusers import FluxTransformer2DModel

    from fluxbooth.job.launch_files import trainer_config_for
    from fluxbooth.train.model import add_lora_adapter, trainable_parameters

    request = parse_request(
        {
            "model_name": "m",
            "dataset_url": "https://example.com/d.zip",
            "instance_prompt": "a sks dog",
            "base_model": str(tiny_model_dir),
            "lora_rank": 4,
            "resolution": 64,
        }
    )
    model = model_size(str(tiny_model_dir))
    spec = job_spec(request, model)
    plan = choose_plan(spec, cpu_machine(), model)
    planned = pick(evaluate_candidates(as_job(spec), cpu_machine(), model))
    config = trainer_config_for(
        spec, plan, base_model=str(tiny_model_dir), instance_dir=tiny_model_dir, class_dir=None, job_dir=tiny_model_dir
    )
    transformer = FluxTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    add_lora_adapter(transformer, config.lora)

    trained = sum(parameter.numel() for parameter in trainable_parameters(transformer))
    assert planned is not None and planned.strategy.training_type == plan.training_type == "lora"
    assert planned.estimate.breakdown["trainable_params"] == trained


def measured_activation_peak(config: dict, resolution: int, checkpoint_every: int) -> int:
    """Allocator peak of one forward+backward on the CPU, weight gradients already allocated, every
    `checkpoint_every`-th block of each stack checkpointed as the trainer does it (0: none)."""
    import torch
    from diffusers import FluxTransformer2DModel
    from torch.profiler import ProfilerActivity, profile

    from fluxbooth.train.model import enable_checkpointing

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**config).to(torch.bfloat16).train()
    enable_checkpointing(model, checkpoint_every)
    image = (resolution // 16) ** 2
    arguments = {
        "hidden_states": torch.randn(1, image, config["in_channels"], dtype=torch.bfloat16),
        "encoder_hidden_states": torch.randn(1, 512, config["joint_attention_dim"], dtype=torch.bfloat16),
        "pooled_projections": torch.randn(1, config["pooled_projection_dim"], dtype=torch.bfloat16),
        "timestep": torch.tensor([0.5], dtype=torch.bfloat16),
        "guidance": torch.tensor([1.0], dtype=torch.bfloat16),
        "img_ids": torch.zeros(image, 3),
        "txt_ids": torch.zeros(512, 3),
        "return_dict": False,
    }
    model(**arguments)[0].float().square().mean().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        model(**arguments)[0].float().square().mean().backward()
    events = sorted(
        (event for event in profiler.profiler.kineto_results.events() if event.name() == "[memory]"),
        key=lambda event: event.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def measured_activation_peaks_with_avx2(config: dict, resolution: int, granularities: list[int]) -> dict[int, int]:
    """measured_activation_peak of each granularity, in one fresh process whose oneDNN is held to AVX2.

    On a CPU with AVX-512 but no native bf16, oneDNN emulates bf16 matmuls with fp32 scratch buffers (measured on
    such a VM: 37.0 MB against 30.7 MB under AVX2 for the checkpointed case), which are neither activations nor
    anything a GPU allocates; every x86-64 CI machine has AVX2, so the measurement is the same on all of them."""
    code = (
        "import json, sys; from tests.plan.test_plan import measured_activation_peak; "
        "config, resolution = json.loads(sys.argv[1]), int(sys.argv[2]); "
        "print(json.dumps({every: measured_activation_peak(config, resolution, every) "
        "for every in json.loads(sys.argv[3])}))"
    )
    finished = subprocess.run(
        [sys.executable, "-c", code, json.dumps(config), str(resolution), json.dumps(granularities)],
        cwd=REPO_ROOT,
        env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"},
        capture_output=True,
        text=True,
        check=True,
    )
    peaks = json.loads(finished.stdout.strip().splitlines()[-1])
    return {int(every): int(peak) for every, peak in peaks.items()}


# Every block, every second one, none: what the planner weighs (plan.candidates.CHECKPOINT_GRANULARITIES).
MEASURED_GRANULARITIES = [1, 2, 0]


@pytest.fixture(scope="module")
def measured_activation_peaks() -> dict[int, int]:
    """FLUX.1's blocks, 3 double and 3 single with 2 of its 24 heads (activations are linear in the heads,
    bench/activations.py), measured at 256² (256 image tokens beside the 512 text tokens; bench/activations.py
    measures larger sizes) once for every granularity the test compares: 512² took over three CPU-minutes."""
    return measured_activation_peaks_with_avx2(SCALED_FLUX_BLOCKS, 256, MEASURED_GRANULARITIES)


SCALED_FLUX_BLOCKS = {**_FLUX_TRANSFORMER_CONFIG, "num_layers": 3, "num_single_layers": 3, "num_attention_heads": 2}


@pytest.mark.parametrize("checkpoint_every", MEASURED_GRANULARITIES)
def test_predicted_activations_match_the_allocator_peak_of_real_flux_blocks(
    checkpoint_every: int, measured_activation_peaks: dict[int, int]
) -> None:
    size = model_size_from_configs(
        "scaled", SCALED_FLUX_BLOCKS, _CLIP_L_CONFIG, _T5_XXL_CONFIG, _FLUX_VAE_CONFIG, source="config"
    )
    job = JobShape(resolution=(256, 256))
    predicted = sum(activation_bytes(size, job, "bf16", checkpoint_every).values())
    # The memory bench's tolerance (bench/activations.py).
    assert predicted == pytest.approx(measured_activation_peaks[checkpoint_every], rel=0.15)


def test_a_refusal_names_the_smaller_job_that_would_fit() -> None:
    # LoRA at 1024^2 without checkpointing needs ≈40 GiB of activations beside 22 GiB of weights.
    with pytest.raises(FluxboothError) as caught:
        choose_plan(
            request_spec(training_type="lora", gradient_checkpointing=False, zero_stage=2),
            gpu_machine(40, 128),
            model_size(FLUX_DEV_NAME),
        )
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "fits with gradient_checkpointing true" in caught.value.message


# ---- the image count (the request does not carry it) ----------------------------------------------


def test_before_the_dataset_is_fetched_the_job_is_sized_for_the_dataset_cap() -> None:
    from fluxbooth.plan import as_job
    from fluxbooth.settings import DatasetLimits

    assert as_job(request_spec()).num_instance_images == DatasetLimits().max_images


def test_cached_embeddings_grow_with_the_instance_image_count() -> None:
    from fluxbooth.plan import as_job
    from fluxbooth.plan.memory import cached_bytes

    model = model_size(FLUX_DEV_NAME)
    strategy = Strategy("lora", True, 2, "none", "none")
    hardware = gpu_machine(80, 256)
    cached = {
        images: estimate_memory(strategy, model, as_job(request_spec(), images), hardware, "bf16").breakdown[
            "host.cached_embeddings"
        ]
        for images in (10, 20)
    }
    per_image = cached_bytes(model, as_job(request_spec(), 1), 2)
    assert cached == {10: 10 * per_image, 20: 20 * per_image}


# ---- checks before launch (issue 12, item 3) --------------------------------------------------------


def test_lora_targets_that_match_no_module_are_refused_listing_the_valid_names() -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(
            request_spec(training_type="lora", lora_target_modules=["to_q", "q_proj", "attn.to_kk"]),
            gpu_machine(80, 256),
            model_size(FLUX_DEV_NAME),
        )
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message.startswith(
        "lora_target_modules: 'q_proj', 'attn.to_kk' match no Linear layer of black-forest-labs/FLUX.1-dev's "
        "transformer; valid names: time_text_embed.timestep_embedder.linear_1, "
    )
    assert ", attn.to_q, attn.to_k, attn.to_v, attn.to_out.0, " in caught.value.message
    assert caught.value.details == {"unmatched": ["q_proj", "attn.to_kk"]}


def test_lora_targets_are_checked_against_a_local_models_own_configs(tiny_model_dir: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(
            request_spec(
                model_size(str(tiny_model_dir)),
                training_type="lora",
                lora_target_modules=["linear_1", "not_a_layer"],
                resolution=(64, 64),
            ),
            cpu_machine(),
            model_size(str(tiny_model_dir)),
        )
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.details == {"unmatched": ["not_a_layer"]}


def test_lora_targets_that_all_match_are_planned() -> None:
    plan = choose_plan(
        request_spec(training_type="lora", lora_target_modules=["attn.to_q", "proj_mlp", "context_embedder"]),
        gpu_machine(80, 256),
        model_size(FLUX_DEV_NAME),
    )
    assert plan.training_type == "lora"


# ---- the figures the docs quote (issue 22) ----------------------------------------------------------------

FULL_FINETUNE_HOST_QUOTE = re.compile(r"full fine-tune[^|]*?needs ≈(\d+) GiB of host RAM")


def test_a_full_fine_tunes_host_ram_is_what_the_planner_chooses_for_one_80_gib_card() -> None:
    # 290 GiB: room for ZeRO-3's offloaded optimizer, not for ZeRO-2's (whose pinned fp32 master, fp32 gradients
    # and bf16 staging buffer round up to 64 + 64 + 32 GiB).
    plan = choose_plan(request_spec(training_type="full"), gpu_machine(80, 290), model_size(FLUX_DEV_NAME))
    assert (plan.zero_stage, plan.offload_optimizer, plan.offload_param) == (3, "cpu", "none")
    assert plan.predicted_host_bytes == full_finetune_host_bytes()


@pytest.mark.parametrize("document", ["docs/gpus.md", "docs/memory.md"])
def test_the_docs_quote_the_planners_figure_for_a_full_fine_tunes_host_ram(document: str) -> None:
    quoted = FULL_FINETUNE_HOST_QUOTE.findall((REPO_ROOT / document).read_text())
    assert quoted, f"{document} no longer says how much host RAM a full fine-tune needs"
    assert set(quoted) == {f"{full_finetune_host_bytes() / GIB:.0f}"}


def test_the_memory_docs_worked_example_shows_the_same_figure() -> None:
    assert f"| {format_bytes(full_finetune_host_bytes())} (" in (REPO_ROOT / "docs" / "memory.md").read_text()


# ---- GPU names as NVML reports them and as people type them ------------------------------------------------


@pytest.mark.parametrize(
    "typed", ["4090", "rtx4090", "RTX 4090", "rtx-4090", "NVIDIA GeForce RTX 4090", "geforce rtx 4090"]
)
def test_an_rtx_4090_is_found_however_it_is_typed(typed: str) -> None:
    assert gpu_spec(typed) == gpu_spec("NVIDIA GeForce RTX 4090")


@pytest.mark.parametrize(
    ("name", "row"),
    [
        ("rtxa6000", "RTX A6000"),
        ("rtx6000ada", "RTX 6000 Ada"),
        ("RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
        ("A100-SXM4-80GB", "A100 SXM"),
        ("NVIDIA L40S", "L40S"),
        ("L40", "L40"),
        ("NVIDIA A100-PCIE-40GB", "A100 PCIe"),
        ("h100 nvl", "H100 NVL"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("a4000", "RTX A4000"),
    ],
)
def test_names_find_their_own_card_and_not_a_card_with_a_shorter_name(name: str, row: str) -> None:
    spec = gpu_spec(name)
    assert spec is not None and spec.name == row


def test_every_row_of_the_gpu_table_is_found_by_its_own_name() -> None:
    assert [gpu_spec(spec.name) for _, spec in GPU_TABLE] == [spec for _, spec in GPU_TABLE]


@pytest.mark.parametrize("name", ["RTX 6000", "rtx4900", "Radeon 7900"])
def test_a_name_of_no_known_card_matches_nothing(name: str) -> None:
    assert gpu_spec(name) is None


@pytest.mark.parametrize(
    ("name", "stream"),
    [
        ("transformer_blocks.3.norm1.linear", "vector"),
        ("transformer_blocks.3.norm1_context.linear", "vector"),
        ("single_transformer_blocks.0.norm.linear", "vector"),
        ("norm_out.linear", "vector"),
        ("time_text_embed.guidance_embedder.linear_2", "vector"),
        ("double_stream_modulation_img.linear", "vector"),
        ("transformer_blocks.3.attn.to_q", "image"),
        ("transformer_blocks.3.ff.net.2", "image"),
        ("x_embedder", "image"),
        ("proj_out", "image"),
        ("transformer_blocks.3.attn.add_k_proj", "text"),
        ("transformer_blocks.3.attn.to_add_out", "text"),
        ("transformer_blocks.3.ff_context.linear_in", "text"),
        ("context_embedder", "text"),
        ("single_transformer_blocks.5.proj_mlp", "joint"),
        ("single_transformer_blocks.5.attn.to_qkv_mlp_proj", "joint"),
    ],
)
def test_each_linear_multiplies_the_tokens_of_its_stream(name: str, stream: str) -> None:
    from fluxbooth.sizing import linear_stream

    assert linear_stream(name) == stream


def test_flux1_dev_forward_flops_count_each_weight_on_its_own_tokens() -> None:
    from fluxbooth.plan.flops import forward_flops

    model = model_size(FLUX_DEV_NAME)
    job = JobShape(resolution=(1024, 1024), max_sequence_length=512)
    by_stream = {"vector": 0, "text": 0, "image": 0, "joint": 0}
    from fluxbooth.sizing import linear_stream

    for layer in model.linear_layers:
        by_stream[linear_stream(layer.name)] += layer.in_features * layer.out_features
    image, text = 4096, 512
    attention = 4 * (image + text) ** 2 * model.transformer.hidden_size * model.transformer.num_blocks
    expected = (
        2
        * (
            by_stream["vector"]
            + by_stream["text"] * text
            + by_stream["image"] * image
            + by_stream["joint"] * (image + text)
        )
        + attention
    )
    assert forward_flops(model, job) == expected
    # 2·P·T for every parameter would count 1.67 times as much.
    assert (2 * model.transformer_params * (image + text) + attention) / forward_flops(model, job) == pytest.approx(
        1.67, abs=0.01
    )


def test_the_modulation_costs_the_same_at_any_resolution() -> None:
    from fluxbooth.plan.flops import forward_flops
    from fluxbooth.sizing import linear_stream

    model = model_size(FLUX_DEV_NAME)
    small, large = JobShape(resolution=(512, 512)), JobShape(resolution=(1024, 1024))
    image_weights = sum(
        layer.in_features * layer.out_features
        for layer in model.linear_layers
        if linear_stream(layer.name) in ("image", "joint")
    )
    shape = model.transformer
    attention = [4 * (tokens + 512) ** 2 * shape.hidden_size * shape.num_blocks for tokens in (1024, 4096)]
    difference = forward_flops(model, large) - forward_flops(model, small)
    assert difference == 2 * image_weights * (4096 - 1024) + attention[1] - attention[0]
