"""Model families (issue 20): told from the model's own files, sized from their published configs, planned on
RunPod's tiers, and each tiny preset a folder its family's diffusers pipeline loads and renders."""

from __future__ import annotations

import functools
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fluxbooth.cli import main as cli_main
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.models.families import (
    FAMILIES,
    FLUX1,
    FLUX1_KONTEXT,
    FLUX2,
    FLUX2_KLEIN,
    default_lora_targets_of,
    family_of,
)
from fluxbooth.models.source import missing_pipeline_files
from fluxbooth.request.limits import MAX_TIMEOUT_SECONDS
from fluxbooth.sizing import PRESET_OF_MODEL, model_size
from fluxbooth.synthetic import build_pipeline, count_parameters, preset

SUPPORTED = (
    "fluxbooth trains these model families: FLUX.1 [dev], [schnell] and Krea [dev] (FluxPipeline); FLUX.1 Kontext [dev] "
    "(FluxKontextPipeline); FLUX.2 [dev] (Flux2Pipeline); FLUX.2 [klein] 4B and 9B (Flux2KleinPipeline)"
)
# Published parameter counts of each full-size preset's components: the configs in published_configs (sources
# cited there), counted on the meta device by the classes diffusers and
# transformers build from them. Cross-checks: FLUX.2-klein-4B's text_encoder/ holds 8.05 GB of bf16 weights
# (4.02 B), Qwen3-8B is published as 8.19 B, Mistral-Small-3.1-24B as 24.0 B.
PUBLISHED_COUNTS = {
    "flux2-dev": {"transformer": 32_223_281_152, "vae": 84_046_115, "text_encoder": 24_011_361_280},
    "flux2-klein-4b": {"transformer": 3_875_544_576, "vae": 84_046_115, "text_encoder": 4_022_468_096},
    "flux2-klein-9b": {"transformer": 9_078_581_248, "vae": 84_046_115, "text_encoder": 8_190_735_360},
    "flux1-kontext-dev": {
        "transformer": 11_901_408_320,
        "vae": 83_819_683,
        "text_encoder": 123_060_480,
        "text_encoder_2": 4_762_310_656,
    },
}
TINY_PIPELINES = {
    "tiny-flux2": "Flux2Pipeline",
    "tiny-flux2-klein": "Flux2KleinPipeline",
    "tiny-kontext": "FluxKontextPipeline",
}
TIERS = {
    "24 GiB": ["--gpu-name", "NVIDIA GeForce RTX 4090", "--gpu-memory", "24GiB", "--host-memory", "62GiB"],
    "48 GiB": ["--gpu-name", "NVIDIA RTX A6000", "--gpu-memory", "48GiB", "--host-memory", "94GiB"],
    "80 GiB": ["--gpu-name", "NVIDIA H100 80GB HBM3", "--gpu-memory", "80GiB", "--host-memory", "188GiB"],
}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_pipeline(preset(name), root / name) for name in (*TINY_PIPELINES, "tiny-schnell")}


def pipeline_folder(tmp_path: Path, class_name: str) -> Path:
    (tmp_path / "transformer").mkdir(parents=True)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": class_name}))
    return tmp_path


# ---- telling the family ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=[family.name for family in FAMILIES])
def test_the_family_is_read_from_model_index(tmp_path: Path, family: object) -> None:
    assert family_of(pipeline_folder(tmp_path, family.pipeline_class)) is family


def test_an_unknown_pipeline_is_refused_naming_the_supported_families(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        family_of(pipeline_folder(tmp_path, "StableDiffusionXLPipeline"))
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert (
        caught.value.message
        == f"base_model: {tmp_path} is a StableDiffusionXLPipeline pipeline (model_index.json); {SUPPORTED}"
    )


def test_the_planner_refuses_an_unknown_family_before_anything_is_fetched(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        model_size(str(pipeline_folder(tmp_path, "QwenImagePipeline")))
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message.endswith(SUPPORTED)


@pytest.mark.parametrize(("guidance", "family"), [(True, FLUX2), (False, FLUX2_KLEIN)])
def test_a_transformer_only_folder_is_told_by_its_transformer_class(
    tmp_path: Path, guidance: bool, family: object
) -> None:
    (tmp_path / "transformer").mkdir()
    config = {"_class_name": "Flux2Transformer2DModel", "guidance_embeds": guidance}
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(config))
    assert family_of(tmp_path) is family


def test_each_tiny_preset_is_its_family(tiny_folders: dict[str, Path]) -> None:
    assert {name: family_of(folder) for name, folder in tiny_folders.items()} == {
        "tiny-flux2": FLUX2,
        "tiny-flux2-klein": FLUX2_KLEIN,
        "tiny-kontext": FLUX1_KONTEXT,
        "tiny-schnell": FLUX1,
    }


def test_a_complete_flux2_folder_needs_no_second_text_encoder(tiny_folders: dict[str, Path]) -> None:
    assert missing_pipeline_files(tiny_folders["tiny-flux2-klein"]) == []


def test_krea_is_sized_and_sampled_as_flux1_dev() -> None:
    krea, dev = model_size("black-forest-labs/FLUX.1-Krea-dev"), model_size("black-forest-labs/FLUX.1-dev")
    assert (krea.family, krea.transformer_params, krea.default_lora_targets) == (
        dev.family,
        dev.transformer_params,
        dev.default_lora_targets,
    )


def test_the_planner_counts_kontexts_control_image_in_the_sequence() -> None:
    from fluxbooth.plan.flops import forward_flops
    from fluxbooth.plan.memory import activation_bytes, sequence_tokens
    from fluxbooth.plan.types import JobShape

    kontext, dev, job = (
        model_size("black-forest-labs/FLUX.1-Kontext-dev"),
        model_size("black-forest-labs/FLUX.1-dev"),
        JobShape(),
    )
    assert (kontext.sequence_images, dev.sequence_images) == (2, 1)
    assert sequence_tokens(kontext, job) == 2 * 64 * 64 + 512 and sequence_tokens(dev, job) == 64 * 64 + 512
    assert forward_flops(kontext, job) > 1.5 * forward_flops(dev, job)
    assert sum(activation_bytes(kontext, job, "bf16").values()) > sum(activation_bytes(dev, job, "bf16").values())


# ---- sizes from the published configs ---------------------------------------------------------------


@functools.cache
def counted(name: str) -> dict[str, int]:
    """count_parameters of a preset, once per test process (counting a 32 B model on the meta device takes
    seconds; a CLI subprocess per preset spent 20-40 s of CI's CPU importing torch, diffusers and transformers)."""
    return count_parameters(preset(name))


@pytest.mark.parametrize("name", sorted(PUBLISHED_COUNTS))
def test_each_full_size_preset_counts_its_components_published_size(name: str) -> None:
    assert counted(name) == PUBLISHED_COUNTS[name]


def test_count_prints_each_components_parameter_count_as_json() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.synthetic", "--preset", "flux2-klein-4b", "--count"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout) == PUBLISHED_COUNTS["flux2-klein-4b"]


@pytest.mark.parametrize("model_id", sorted(PRESET_OF_MODEL))
def test_the_planners_formulas_match_the_classes_built_from_the_same_configs(model_id: str) -> None:
    size, counts = model_size(model_id), counted(PRESET_OF_MODEL[model_id])
    assert size.transformer_params == counts["transformer"]
    assert size.text_encoder_params + size.text_encoder_2_params == counts["text_encoder"] + counts.get(
        "text_encoder_2", 0
    )
    assert size.vae_params == counts["vae"]


def test_the_planners_linears_are_the_flux2_transformers(tiny_folders: dict[str, Path]) -> None:
    import torch
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel.from_pretrained(tiny_folders["tiny-flux2-klein"], subfolder="transformer")
    linears = {
        name: (module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    size = model_size(str(tiny_folders["tiny-flux2-klein"]))
    assert {layer.name: (layer.in_features, layer.out_features) for layer in size.linear_layers} == linears


def test_default_lora_targets_adapt_every_attention_and_single_block_projection(tiny_folders: dict[str, Path]) -> None:
    from diffusers import Flux2Transformer2DModel
    from peft import LoraConfig

    folder = tiny_folders["tiny-flux2-klein"]
    model = Flux2Transformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(default_lora_targets_of(folder))))
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in model.named_parameters() if ".lora_A." in name}
    assert adapted == {
        *(
            f"transformer_blocks.{block}.attn.{name}"
            for block in (0, 1)
            for name in ("to_q", "to_k", "to_v", "to_out.0")
        ),
        *(
            f"single_transformer_blocks.{block}.attn.{name}"
            for block in (0, 1)
            for name in ("to_qkv_mlp_proj", "to_out")
        ),
    }


def test_the_planner_sizes_a_flux2_lora_without_targets_with_the_familys(tiny_folders: dict[str, Path]) -> None:
    from fluxbooth.host.hardware import GIB, hypothetical_hardware
    from fluxbooth.plan import JobShape, Strategy, estimate_memory

    size = model_size(str(tiny_folders["tiny-flux2-klein"]))
    card = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=24 * GIB, host_memory_bytes=64 * GIB, disk_bytes=500 * GIB, gpu_name="NVIDIA L4"
    )
    estimate = estimate_memory(Strategy("lora", True, 2, "none", "none"), size, JobShape(lora_rank=4), card, "bf16")
    assert estimate.breakdown["trainable_params"] == size.lora_params(4, size.default_lora_targets) > 0


# ---- the tiny presets are their family's pipelines ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(TINY_PIPELINES))
def test_a_tiny_preset_loads_with_its_familys_pipeline_and_renders(tiny_folders: dict[str, Path], name: str) -> None:
    import diffusers
    import torch

    pipeline = getattr(diffusers, TINY_PIPELINES[name]).from_pretrained(tiny_folders[name])
    pipeline.set_progress_bar_config(disable=True)
    arguments = {"max_area": 64 * 64} if name == "tiny-kontext" else {}
    image = pipeline(
        prompt="a photo of sks dog",
        height=64,
        width=64,
        num_inference_steps=2,
        max_sequence_length=256,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **arguments,
    ).images[0]
    assert image.shape == (64, 64, 3)


# ---- plans on RunPod's tiers --------------------------------------------------------------------------


def plan_report(model_id: str, tier: list[str], tmp_path: Path) -> tuple[int, dict[str, object]]:
    environ = {
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1",
    }
    out = io.StringIO()
    # The longest deadline a request may set, so a refusal is about memory, not time.
    arguments = ["plan", "--base-model", model_id, "--gpus", "1", "--cpus", "16", "--disk", "200GiB", *tier]
    code = cli_main([*arguments, "--deadline", str(MAX_TIMEOUT_SECONDS), "--json"], environ, out)
    return code, json.loads(out.getvalue())


@pytest.mark.parametrize("tier", sorted(TIERS))
@pytest.mark.parametrize(
    "model_id",
    [
        "black-forest-labs/FLUX.2-dev",
        "black-forest-labs/FLUX.2-klein-4B",
        "black-forest-labs/FLUX.2-klein-9B",
        "black-forest-labs/FLUX.1-Kontext-dev",
    ],
)
def test_plan_json_answers_for_each_full_size_family_with_a_plan_or_a_refusal_with_numbers(
    model_id: str, tier: str, tmp_path: Path
) -> None:
    code, report = plan_report(model_id, TIERS[tier], tmp_path)
    if report.get("chosen"):
        assert code == 0
        assert report["chosen"]["gpu_bytes"] > 0 and report["chosen"]["host_bytes"] > 0
    else:
        assert report["error"]["code"] == "does_not_fit"
        assert "GiB" in report["error"]["message"]


def test_the_klein_models_train_on_a_24_gib_card(tmp_path: Path) -> None:
    for model_id in ("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-9B"):
        _, report = plan_report(model_id, TIERS["24 GiB"], tmp_path)
        assert report["chosen"]["training_type"] == "lora", model_id
