"""A LoRA job through the worker (run_job, what handler.py runs) on each tiny family preset: the real trainer
under `accelerate launch` + DeepSpeed ZeRO-2 on the CPU trains, exports both LoRA formats and validates with
the family's sampling defaults; the diffusers LoRA loads into the family's pipeline and changes its output,
and the ComfyUI file (the family's original key layout) changes it the same way."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from fluxbooth.synthetic import build_pipeline, preset
from tests.conftest import worker_environment
from tests.support.factories import make_dataset_zip, to_base64

pytestmark = pytest.mark.slow

# (preset, the family's pipeline, validation steps and guidance: the family's sampling defaults)
FAMILIES = {
    "tiny-flux2-klein": ("Flux2KleinPipeline", 50, 4.0),  # a base (not distilled) klein: true CFG
    "tiny-flux2": ("Flux2Pipeline", 50, 4.0),
    "tiny-schnell": ("FluxPipeline", 4, 0.0),
}


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("family-bases")
    return {name: build_pipeline(preset(name), root / name) for name in FAMILIES}


def lora_request(base: Path) -> dict[str, Any]:
    return {
        "model_name": f"{base.name}-lora",
        "base_model": str(base),
        "dataset": to_base64(make_dataset_zip(count=3, size=(96, 80))),
        "instance_prompt": "a photo of sks dog",
        "training_type": "lora",
        "lora_rank": 4,
        "learning_rate": 1e-3,
        "steps": 3,
        "resolution": 64,
        "seed": 7,
        "validation_prompts": ["a photo of sks dog"],
    }


def local_file(artifact: dict[str, Any]) -> Path:
    assert artifact["uri"].startswith("file://"), artifact
    return Path(urlparse(artifact["uri"]).path)


@pytest.fixture(scope="module")
def family_runs(
    family_bases: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
    model_cache_dir: Path,
    torch_extensions_dir: Path,
) -> dict[str, dict[str, Any]]:
    """One job per family, run once for the module (each takes a minute or two on a CPU)."""
    results = {}
    for name, base in family_bases.items():
        root = tmp_path_factory.mktemp(f"worker-{name}")
        settings = WorkerSettings.from_environ(worker_environment(root, model_cache_dir, torch_extensions_dir))
        results[name] = asyncio.run(run_job(lora_request(base), job_id=f"family-{name}", settings=settings))
    return results


def artifact_named(result: dict[str, Any], name: str) -> Path:
    matches = [artifact for artifact in result["artifacts"] if artifact["name"] == name]
    assert len(matches) == 1, [artifact["name"] for artifact in result["artifacts"]]
    return local_file(matches[0])


def render(pipeline_class: str, base: Path, lora: Path | None) -> Any:
    import diffusers
    import torch

    pipeline = getattr(diffusers, pipeline_class).from_pretrained(base)
    pipeline.set_progress_bar_config(disable=True)
    if lora is not None:
        pipeline.load_lora_weights(lora.parent, weight_name=lora.name)
    return pipeline(
        prompt="a photo of sks dog",
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=1.0,
        max_sequence_length=256,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images[0]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_lora_job_trains_on_the_familys_tiny_model(family_runs: dict[str, dict[str, Any]], name: str) -> None:
    result = family_runs[name]
    assert "error" not in result, result
    assert (result["plan"]["training_type"], result["plan"]["zero_stage"]) == ("lora", 2)
    assert result["metrics"]["steps"] == 3 and math.isfinite(result["metrics"]["final_loss"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_validation_renders_with_the_familys_sampling_defaults(
    family_runs: dict[str, dict[str, Any]], name: str
) -> None:
    index = json.loads(artifact_named(family_runs[name], "validation/validation.json").read_text())
    _, steps, guidance = FAMILIES[name]
    # The base model's render before the first step (likeness scoring's zero) and the final one.
    assert [(image["training_step"], image["steps"]) for image in index["images"]] == [(0, steps), (3, steps)]
    assert index["guidance_scale"] == guidance
    assert artifact_named(family_runs[name], "validation/validation_00.png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_diffusers_lora_loads_into_the_familys_pipeline_and_changes_its_output(
    family_runs: dict[str, dict[str, Any]], family_bases: dict[str, Path], name: str
) -> None:
    pipeline_class = FAMILIES[name][0]
    base, tuned = (
        render(pipeline_class, family_bases[name], None),
        render(
            pipeline_class,
            family_bases[name],
            artifact_named(family_runs[name], "lora/pytorch_lora_weights.safetensors"),
        ),
    )
    assert float((tuned - base).abs().max()) > 0


# diffusers' reader of FLUX.1 kohya files assumes FLUX.1's full widths, so only FLUX.2's is read back here
# (FLUX.1's ComfyUI file is checked against its adapter in tests/trainer/test_trainer_lora.py).
@pytest.mark.parametrize("name", ["tiny-flux2", "tiny-flux2-klein"])
def test_the_comfyui_lora_changes_the_output_as_the_diffusers_one_does(
    family_runs: dict[str, dict[str, Any]], family_bases: dict[str, Path], name: str
) -> None:
    """diffusers reads kohya files by converting the original (BFL) layout back: the same renders show that
    every module's change survived the export's key layout."""
    pipeline_class = FAMILIES[name][0]
    diffusers_file = render(
        pipeline_class, family_bases[name], artifact_named(family_runs[name], "lora/pytorch_lora_weights.safetensors")
    )
    comfyui_file = render(
        pipeline_class, family_bases[name], artifact_named(family_runs[name], "lora/lora_comfyui.safetensors")
    )
    assert float((diffusers_file - comfyui_file).abs().max()) < 1e-3


# ---- FLUX.1 Kontext: image pairs ----------------------------------------------------------------------------


def pairs_zip() -> bytes:
    from tests.support.factories import make_image, make_zip

    members = []
    for index in range(3):
        members.append((f"edit{index}.png", make_image("PNG", size=(96, 80), color=(200, 40 + 30 * index, 40))))
        members.append((f"edit{index}.txt", b"make the sky red\n"))
        members.append((f"control/edit{index}.png", make_image("PNG", size=(96, 80), color=(40, 40 + 30 * index, 200))))
    return make_zip(members)


@pytest.fixture(scope="module")
def kontext_run(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    from tests.support.factories import make_image

    root = tmp_path_factory.mktemp("worker-kontext")
    base = build_pipeline(preset("tiny-kontext"), root / "tiny-kontext")
    settings = WorkerSettings.from_environ(worker_environment(root, model_cache_dir, torch_extensions_dir))
    request = {
        **lora_request(base),
        "dataset": to_base64(pairs_zip()),
        "instance_prompt": "make the sky red",
        "validation_prompts": ["make the sky red"],
        "validation_images": [to_base64(make_image("JPEG", size=(90, 70), color=(40, 90, 200)))],
    }
    progress: list[dict[str, Any]] = []
    result = asyncio.run(run_job(request, job_id="family-kontext", settings=settings, progress=progress.append))
    return result, progress, base


def test_a_kontext_job_trains_on_the_image_pairs(
    kontext_run: tuple[dict[str, Any], list[dict[str, Any]], Path],
) -> None:
    result, progress, _ = kontext_run
    assert "error" not in result, result
    assert result["dataset"]["control_images"] == 3
    assert any(update.get("stage") == "cache" and update.get("image_pairs") == 3 for update in progress)
    assert math.isfinite(result["metrics"]["final_loss"])


def test_a_kontext_job_validates_with_the_control_image_and_kontexts_sampling(
    kontext_run: tuple[dict[str, Any], list[dict[str, Any]], Path],
) -> None:
    result, _, _ = kontext_run
    index = json.loads(artifact_named(result, "validation/validation.json").read_text())
    # The base model's render before the first step (likeness scoring's zero) and the final one.
    assert ([image["steps"] for image in index["images"]], index["guidance_scale"]) == ([28, 28], 3.5)


def test_the_kontext_lora_loads_into_flux_kontext_pipeline_and_changes_an_edit(
    kontext_run: tuple[dict[str, Any], list[dict[str, Any]], Path],
) -> None:
    import torch
    from diffusers import FluxKontextPipeline
    from PIL import Image

    result, _, base = kontext_run
    lora = artifact_named(result, "lora/pytorch_lora_weights.safetensors")
    control = Image.new("RGB", (64, 64), (40, 90, 200))

    def edit(with_lora: bool) -> torch.Tensor:
        pipeline = FluxKontextPipeline.from_pretrained(base)
        pipeline.set_progress_bar_config(disable=True)
        if with_lora:
            pipeline.load_lora_weights(lora.parent, weight_name=lora.name)
        return pipeline(
            image=control,
            prompt="make the sky red",
            height=64,
            width=64,
            max_area=64 * 64,
            _auto_resize=False,
            num_inference_steps=2,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images[0]

    assert float((edit(True) - edit(False)).abs().max()) > 0


# ---- FLUX.2 full fine-tune ----------------------------------------------------------------------------------


def test_a_flux2_full_fine_tune_exports_a_single_file_in_flux2s_original_layout(
    family_bases: dict[str, Path], tmp_path: Path, model_cache_dir: Path, torch_extensions_dir: Path
) -> None:
    """The single file uses FLUX.2's original (BFL) names; diffusers' own FLUX.2 single-file converter reads it
    back to exactly the diffusers export."""
    import torch
    from diffusers import Flux2Transformer2DModel

    base = family_bases["tiny-flux2-klein"]
    settings = WorkerSettings.from_environ(worker_environment(tmp_path, model_cache_dir, torch_extensions_dir))
    request = {
        key: value
        for key, value in lora_request(base).items()
        if key not in ("lora_rank", "learning_rate", "validation_prompts")
    }
    request.update(training_type="full", steps=2, output_formats=["diffusers", "single_file"])
    result = asyncio.run(run_job(request, job_id="family-flux2-full", settings=settings))
    assert "error" not in result, result
    single_file = artifact_named(result, "flux_transformer.safetensors")
    exported = artifact_named(result, "transformer/config.json").parent
    single = Flux2Transformer2DModel.from_single_file(
        single_file, config=str(base), subfolder="transformer", torch_dtype=torch.float32
    )
    reference = Flux2Transformer2DModel.from_pretrained(exported, torch_dtype=torch.float32)
    single_state, reference_state = single.state_dict(), reference.state_dict()
    assert single_state.keys() == reference_state.keys()
    assert all(torch.equal(single_state[name], reference_state[name]) for name in reference_state)
