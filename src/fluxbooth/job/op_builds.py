"""The DeepSpeed ops a job's trainer must JIT-build before its first step: counted in the plan (its loading
phase) and said in the progress (the `launch` stage names them), so a first run on a fresh environment is
neither a silent pause of minutes nor a deadline missed for a build the plan did not know about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fluxbooth.host.op_cache import OP_BUILD_SECONDS, op_cache_dir, ops_loaded, unbuilt_ops
from fluxbooth.plan import Plan
from fluxbooth.settings import WorkerSettings


def extensions_dir(settings: WorkerSettings) -> Path:
    """The folder the trainer builds and loads its ops in (its TORCH_EXTENSIONS_DIR)."""
    return op_cache_dir(settings.environ, settings.cache_dir)


def ops_to_build(plan: Plan, extensions: Path) -> tuple[str, ...]:
    """The ops this plan's trainer loads that are not built for this environment yet."""
    loaded = ops_loaded(
        accelerator=plan.accelerator,
        use_deepspeed=plan.use_deepspeed,
        optimizer=plan.optimizer,
        nvme=bool(plan.nvme_path),
    )
    return unbuilt_ops(extensions, loaded)


def build_seconds(ops: tuple[str, ...]) -> float:
    return len(ops) * OP_BUILD_SECONDS


def launch_details(steps: int, ops: tuple[str, ...]) -> dict[str, Any]:
    """The `launch` stage's payload: the steps, and the ops the trainer builds first with their predicted time."""
    if not ops:
        return {"steps": steps}
    return {"steps": steps, "building_ops": list(ops), "build_seconds": round(build_seconds(ops))}
