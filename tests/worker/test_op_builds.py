"""A job whose DeepSpeed ops are not built for this environment: the plan counts their build (in the trainer's
loading phase) and the `launch` progress names them (issue 43, item 6)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.host.op_cache import OP_BUILD_SECONDS
from fluxbooth.job.op_builds import extensions_dir, launch_details, ops_to_build
from fluxbooth.plan import JobShape, Plan, choose_plan
from fluxbooth.progress import describe
from fluxbooth.settings import WorkerSettings
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size
from tests.support.guide_job import GUIDE_DEFAULT_PLAN
from tests.support.op_folders import built

CPU_PLAN = replace(GUIDE_DEFAULT_PLAN, accelerator="cpu")  # the demo's: CPU Adam on DeepSpeed's CPU accelerator


def test_the_demos_plan_on_a_fresh_environment_builds_cpu_adam_and_the_cpu_collectives(tmp_path: Path) -> None:
    assert ops_to_build(CPU_PLAN, tmp_path) == ("cpu_adam", "deepspeed_shm_comm")


def test_ops_built_for_this_environment_are_not_built_again(tmp_path: Path) -> None:
    assert ops_to_build(CPU_PLAN, built(tmp_path, "cpu_adam", "deepspeed_shm_comm")) == ()


@pytest.mark.parametrize(
    ("plan", "ops"),
    [
        (GUIDE_DEFAULT_PLAN, ("cpu_adam",)),
        (replace(GUIDE_DEFAULT_PLAN, optimizer="DeepSpeedCPULion"), ("cpu_lion",)),
        (replace(GUIDE_DEFAULT_PLAN, optimizer="DeepSpeedCPUAdagrad"), ("cpu_adagrad",)),
        (replace(GUIDE_DEFAULT_PLAN, offload_optimizer="none", optimizer="AdamW"), ()),
        (replace(GUIDE_DEFAULT_PLAN, offload_optimizer="nvme", nvme_path="/nvme"), ("cpu_adam", "async_io")),
        (replace(CPU_PLAN, use_deepspeed=False, optimizer="AdamW"), ()),
    ],
    ids=["cuda offload", "lion", "adagrad", "not offloaded", "nvme", "no deepspeed"],
)
def test_the_ops_a_plan_loads(tmp_path: Path, plan: Plan, ops: tuple[str, ...]) -> None:
    assert ops_to_build(plan, tmp_path) == ops


def test_the_launch_progress_names_the_ops_to_build_and_their_time() -> None:
    details = launch_details(8, ("cpu_adam", "deepspeed_shm_comm"))
    assert details == {"steps": 8, "building_ops": ["cpu_adam", "deepspeed_shm_comm"], "build_seconds": 400}
    assert describe({"stage": "launch", **details}) == (
        "launch  build_seconds=400  building_ops=cpu_adam,deepspeed_shm_comm  steps=8"
    )


def test_with_every_op_built_the_launch_progress_is_the_steps_alone() -> None:
    assert launch_details(8, ()) == {"steps": 8}


def test_the_worker_builds_in_its_keyed_folder_unless_torch_extensions_dir_is_set(tmp_path: Path) -> None:
    keyed = extensions_dir(WorkerSettings.from_environ({"FLUXBOOTH_CACHE_DIR": str(tmp_path)}))
    assert keyed.parent == tmp_path / "torch_extensions" and keyed.name.startswith("py3.")
    explicit = WorkerSettings.from_environ({"FLUXBOOTH_CACHE_DIR": str(tmp_path), "TORCH_EXTENSIONS_DIR": "/opt/ops"})
    assert extensions_dir(explicit) == Path("/opt/ops")


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


def plan_of(flux_dev: ModelSize, **kwargs: object) -> Plan:
    hardware = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=48 * GIB, host_memory_bytes=62 * GIB, disk_bytes=200 * GIB
    )
    job = JobShape(training_type="lora", num_instance_images=4)
    return choose_plan(job, hardware, flux_dev, deadline_seconds=None, **kwargs)  # type: ignore[arg-type]


def test_the_plan_counts_the_op_build_in_the_trainers_loading(flux_dev: ModelSize) -> None:
    built_already, to_build = plan_of(flux_dev), plan_of(flux_dev, op_build_seconds=2 * OP_BUILD_SECONDS)
    loading = {plan: dict(plan.phases)["loading"].seconds for plan in (built_already, to_build)}
    assert loading[to_build] == pytest.approx(loading[built_already] + 400, abs=0.1)
    assert to_build.predicted_total_seconds == pytest.approx(
        (built_already.predicted_total_seconds or 0) + 400, abs=0.2
    )
