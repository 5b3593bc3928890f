"""LoRA under ZeRO-2 and ZeRO-3: training and the diffusers and ComfyUI exports.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.support.trainer_jobs import (
    LORA_FORMATS,
    TrainerRun,
    assert_succeeded,
    base_image,
    lora_pipeline,
    make_plan,
    new_job,
    render,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# LoRA under ZeRO-2 (optimizer offload) and ZeRO-3 (parameter offload)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_zero2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora")
    run = new_job(
        tmp_path_factory.mktemp("lora-zero2"), tiny_base, plan=plan, steps=3, export_formats=LORA_FORMATS
    ).launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def lora_zero3(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu")
    run = new_job(
        tmp_path_factory.mktemp("lora-zero3"), tiny_base, plan=plan, steps=2, export_formats=LORA_FORMATS
    ).launch()
    assert_succeeded(run)
    return run


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
    weights = [key for key in keys if not key.endswith(".alpha")]
    assert {key.rsplit(".", 2)[-2] for key in weights} == {"lora_A", "lora_B"}
    # One alpha per adapted module, beside its weights (what ComfyUI and diffusers both read).
    assert sorted(key.removesuffix(".alpha") for key in keys if key.endswith(".alpha")) == sorted(
        {key.rsplit(".", 2)[0] for key in weights}
    )


def test_lora_export_restores_alpha_when_loaded(lora_zero2: TrainerRun, tiny_base: Path) -> None:
    pipeline = lora_pipeline(tiny_base, lora_zero2.artifact("lora_diffusers"))
    (adapter_config,) = pipeline.transformer.peft_config.values()
    assert (adapter_config.r, adapter_config.lora_alpha) == (4, 8.0)


def test_lora_comfyui_export_changes_each_layer_like_the_diffusers_export(
    lora_zero2: TrainerRun, tiny_base: Path
) -> None:
    from diffusers import FluxTransformer2DModel

    from fluxbooth.train.export.key_layouts import (
        comfyui_lora_effects,
        diffusers_effects_as_comfyui,
        diffusers_lora_effects,
        fused_split_sizes,
    )

    comfy = load_file(lora_zero2.artifact("lora_comfyui"))
    assert all(key.startswith("lora_unet_") for key in comfy)
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in comfy
    diffusers_lora = {
        key.removeprefix("transformer."): value
        for key, value in load_file(lora_zero2.artifact("lora_diffusers")).items()
    }
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


def safetensors_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as opened:
        return dict(opened.metadata() or {})


# The export's metadata keys that record when it was trained (kohya's and the model spec's): the only bytes
# that differ between two runs of one request on one machine.
TRAINING_TIME_KEYS = {"modelspec.date", "modelspec.title", "ss_training_started_at", "ss_training_finished_at"}


def test_the_same_request_on_the_same_machine_trains_bit_identical_weights(
    lora_zero2: TrainerRun, tiny_base: Path, tmp_path: Path
) -> None:
    """docs/request.md's `seed`: the same request and photos, run again on the same machine (same hardware,
    image and thread count) in another job folder, train the same weights to the bit; the files differ only in
    the metadata that records when they were trained, so their sha256 differs on every run."""
    again = new_job(
        tmp_path / "again", tiny_base, plan=make_plan(training_type="lora"), steps=3, export_formats=LORA_FORMATS
    ).launch()
    assert_succeeded(again)

    for kind in ("lora_diffusers", "lora_comfyui"):
        first, second = load_file(lora_zero2.artifact(kind)), load_file(again.artifact(kind))
        assert first.keys() == second.keys()
        assert [key for key in first if not torch.equal(first[key], second[key])] == [], kind
        metadata = safetensors_metadata(lora_zero2.artifact(kind)), safetensors_metadata(again.artifact(kind))
        differing = {
            key for key in metadata[0].keys() | metadata[1].keys() if metadata[0].get(key) != metadata[1].get(key)
        }
        assert differing <= TRAINING_TIME_KEYS, kind
