"""ZeRO-3 with NVMe offload.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.trainer_jobs import (
    TrainerJob,
    TrainerRun,
    assert_refused,
    assert_succeeded,
    base_image,
    load_pipeline,
    lora_pipeline,
    make_plan,
    new_job,
    read_json,
    render,
    transformer_state,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# ZeRO-3 with NVMe offload (DeepSpeed's async_io op over libaio; CI installs libaio-dev)
# --------------------------------------------------------------------------------------------------
# DeepSpeed only swaps what is worth an I/O: tensors of at least 1 MiB (async_io's minimum), parameters beyond
# `max_in_cpu` elements (default 1e9: FLUX's 11.9e9 spill to disk, a small model never does; 0 here) and above
# `stage3_param_persistence_threshold` (the worker's 1e5 keeps every tiny parameter; 0 here). The tiny
# transformer's largest matrix is 16 KiB, so these runs use a wider one (one block of each kind, 8.5 M
# parameters, feed-forward matrices of 1.1 MiB).
NVME_TEST_TRANSFORMER = {
    "attention_head_dim": 192,
    "axes_dims_rope": [32, 80, 80],
    "num_layers": 1,
    "num_single_layers": 1,
}
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


def test_full_zero3_nvme_swaps_parameters_and_optimizer_state_to_disk(
    full_nvme: TrainerRun, wider_tiny_base: Path
) -> None:
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

    transformer = FluxTransformer2DModel.from_pretrained(
        full_nvme.artifact("diffusers_transformer"), torch_dtype=torch.float32
    )
    image = render(load_pipeline(wider_tiny_base, transformer=transformer))
    assert float(abs(image - base_image(wider_tiny_base)).max()) > 1e-4


def test_lora_over_an_nvme_offloaded_base_swaps_the_frozen_base_and_exports_a_loadable_adapter(
    libaio: None, wider_tiny_base: Path, tmp_path: Path
) -> None:
    run = nvme_job(tmp_path, wider_tiny_base, "lora", checkpoint_every=0).launch()

    assert_succeeded(run)
    assert run.metrics["nvme_swap_peak_bytes"]["params"] >= MIB
    image = render(lora_pipeline(wider_tiny_base, run.artifact("lora_diffusers")))
    assert float(abs(image - base_image(wider_tiny_base)).max()) > 1e-4


def test_lora_over_an_nvme_offloaded_base_with_gradient_checkpointing_is_refused_naming_the_deepspeed_bug(
    tiny_base: Path, tmp_path: Path
) -> None:
    run = nvme_job(tmp_path, tiny_base, "lora", checkpoint_every=1).launch()

    assert_refused(run, "invalid_config", "#3062", "offload_param 'cpu'", "gradient_checkpointing off")
