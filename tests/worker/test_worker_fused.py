"""A full fine-tune through the worker (run_job, what handler.py runs) with `fused_backward_pass: true`: the
demo request on the tiny model trains as Adafactor fused into the backward pass without DeepSpeed, exports
the full model, and a job resumed from its checkpoint ends on the uninterrupted job's weights."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from fluxbooth.contract.names import FUSED_ADAFACTOR_CLASS
from fluxbooth.job.run import run_job
from fluxbooth.settings import WorkerSettings
from tests.conftest import worker_environment
from tests.support.factories import make_dataset_zip, to_base64
from tests.support.fixed_noise_loss import OVERFIT_LOSS_RATIO

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
STEPS, CHECKPOINT_EVERY = 4, 2


def fused_input(**overrides: Any) -> dict[str, Any]:
    demo = json.loads((REPO_ROOT / "test_input.json").read_text())["input"]
    return {**demo, "training_type": "full", "fused_backward_pass": True, "steps": STEPS, **overrides}


@pytest.fixture(scope="module")
def settings(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> WorkerSettings:
    return WorkerSettings.from_environ(
        worker_environment(tmp_path_factory.mktemp("worker-fused"), model_cache_dir, torch_extensions_dir)
    )


@pytest.fixture(scope="module")
def whole(settings: WorkerSettings) -> dict[str, Any]:
    request = fused_input(model_name="sks-fused", checkpointing_steps=CHECKPOINT_EVERY)
    result = asyncio.run(run_job(request, job_id="fused-whole", settings=settings))
    assert "error" not in result, result
    return result


@pytest.fixture(scope="module")
def resumed(settings: WorkerSettings, whole: dict[str, Any]) -> dict[str, Any]:
    # Another model name, so its exports land beside the uninterrupted job's instead of over them.
    request = fused_input(model_name="sks-fused-resumed", resume_from=whole["checkpoints"][0])
    result = asyncio.run(run_job(request, job_id="fused-resumed", settings=settings))
    assert "error" not in result, result
    return result


def transformer_weights(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    files = [
        Path(urlparse(artifact["uri"]).path)
        for artifact in result["artifacts"]
        if artifact["name"].startswith("transformer/") and artifact["name"].endswith(".safetensors")
    ]
    assert files, [artifact["name"] for artifact in result["artifacts"]]
    return {name: tensor for path in files for name, tensor in load_file(path).items()}


def test_the_job_runs_adafactor_fused_into_the_backward_pass_without_deepspeed(whole: dict[str, Any]) -> None:
    assert (whole["plan"]["training_type"], whole["plan"]["fused_backward_pass"], whole["plan"]["use_deepspeed"]) == (
        "full",
        True,
        False,
    )
    assert whole["metrics"]["optimizer"] == FUSED_ADAFACTOR_CLASS


def test_the_job_exports_a_bf16_transformer_and_checkpoints_halfway(whole: dict[str, Any]) -> None:
    weights = transformer_weights(whole)
    assert {tensor.dtype for tensor in weights.values()} == {torch.bfloat16}
    assert [uri.rsplit("/", 1)[-1] for uri in whole["checkpoints"]] == [f"checkpoint-{CHECKPOINT_EVERY}"]


def test_the_exported_weights_moved_away_from_the_base(whole: dict[str, Any], settings: WorkerSettings) -> None:
    base_folder = settings.cache_dir / "models" / "tiny-flux" / "transformer"
    base = {name: tensor for path in base_folder.glob("*.safetensors") for name, tensor in load_file(path).items()}
    trained = transformer_weights(whole)
    assert base.keys() == trained.keys()
    assert any(not torch.equal(base[name], trained[name].to(base[name].dtype)) for name in base)


def test_a_job_resumed_from_the_checkpoint_ends_on_the_uninterrupted_jobs_weights(
    whole: dict[str, Any], resumed: dict[str, Any]
) -> None:
    assert resumed["metrics"]["resumed_from_step"] == CHECKPOINT_EVERY
    assert resumed["plan"]["fused_backward_pass"] is True
    expected, actual = transformer_weights(whole), transformer_weights(resumed)
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[name], actual[name]) for name in expected)


@pytest.fixture(scope="module")
def overfit_runs(
    tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path
) -> dict[bool, dict[str, Any]]:
    """One photo, 40 steps at a high rate, the fixed-noise loss measured (`learning_check`): the fused pass and, with
    `fused_backward_pass: false`, the ZeRO-2 AdamW run the planner chooses on this CPU instead."""
    root = tmp_path_factory.mktemp("worker-overfit")
    settings = WorkerSettings.from_environ(
        {**worker_environment(root, model_cache_dir, torch_extensions_dir), "FLUXBOOTH_MIN_IMAGES": "1"}
    )
    runs = {}
    for fused in (True, False):
        request = fused_input(
            model_name=f"sks-overfit-{fused}",
            dataset=to_base64(make_dataset_zip(count=1, size=(64, 64))),
            fused_backward_pass=fused,
            steps=40,
            learning_rate=1e-3,
            learning_check=True,
        )
        runs[fused] = asyncio.run(run_job(request, job_id=f"overfit-{fused}", settings=settings))
        assert "error" not in runs[fused], runs[fused]
    return runs


def test_through_the_worker_the_fused_pass_lowers_the_fixed_noise_loss_as_zero2_adamw_does(
    overfit_runs: dict[bool, dict[str, Any]],
) -> None:
    fused, zero2 = overfit_runs[True]["metrics"], overfit_runs[False]["metrics"]
    assert (fused["optimizer"], zero2["optimizer"]) == (FUSED_ADAFACTOR_CLASS, "DeepSpeedCPUAdam")
    fused_loss, zero2_loss = fused["fixed_noise_loss"], zero2["fixed_noise_loss"]
    assert fused_loss["start"] == zero2_loss["start"]
    assert fused_loss["end"] < OVERFIT_LOSS_RATIO * fused_loss["start"], fused_loss
    assert zero2_loss["end"] < OVERFIT_LOSS_RATIO * zero2_loss["start"], zero2_loss
    assert fused_loss["end"] == pytest.approx(zero2_loss["end"], rel=0.05)
