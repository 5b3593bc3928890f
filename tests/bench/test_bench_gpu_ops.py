"""bench/gpu.py builds no DeepSpeed op: no op builder is named on its code path, and the plans of its FLUX.1
runs, on the cards it emulates, load no op but CPU Adam, which their trainer builds as a job's would."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import pytest

from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.host.op_cache import OPTIMIZER_OPS, ops_loaded
from fluxbooth.plan import choose_plan
from fluxbooth.request.model import parse_request
from fluxbooth.sizing import FLUX_DEV_NAME, model_size
from tests.support.specs import job_spec

REPO = Path(__file__).resolve().parents[2]
BENCH_FILES = ("gpu.py", "gpu_runner.py", "gpu_results.py")
# The lent machine: one H200 (about 139 GiB), 128 GiB of host RAM, 16 cores; a card's size is emulated.
WHOLE_GPU_GIB = 139
HOST_GIB = 128


def names_in(path: Path) -> set[str]:
    """Every identifier, attribute and string constant of a module's source."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


@pytest.mark.parametrize("name", BENCH_FILES)
def test_the_gpu_bench_names_no_op_builder(name: str) -> None:
    names = names_in(REPO / "bench" / name)

    assert not {found for found in names if "Builder" in found or "op_builder" in found}


def test_the_flux1_runs_plans_load_no_op_but_the_cpu_adam_their_trainer_builds(gpu: ModuleType) -> None:
    model = model_size(FLUX_DEV_NAME)
    loaded: set[str] = set()
    for run in gpu.sequence(gpu.GPU_MODE):
        if run.model != "full":
            continue
        hardware = hypothetical_hardware(
            gpus=1,
            gpu_memory_bytes=int((run.card_gib or WHOLE_GPU_GIB) * GIB),
            host_memory_bytes=HOST_GIB * GIB,
            disk_bytes=60 * GIB,
            cpu_count=16,
            gpu_name="NVIDIA H200",
        )
        request = {"model_name": run.name, "dataset_url": "https://example.com/d.zip", "instance_prompt": "sks"}
        plan = choose_plan(job_spec(parse_request({**request, **run.fields})), hardware, model, instance_images=4)
        loaded |= set(
            ops_loaded(
                accelerator="cuda",
                use_deepspeed=plan.use_deepspeed,
                optimizer=plan.optimizer,
                nvme=bool(plan.nvme_path),
            )
        )

    assert loaded <= {OPTIMIZER_OPS["DeepSpeedCPUAdam"]}
