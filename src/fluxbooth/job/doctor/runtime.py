"""The checks of the training runtime: the probe run in a child process and what its report says of CUDA,
DeepSpeed and its ops, accelerate; the op-build locks a killed build leaves. No torch here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fluxbooth.host.hardware import Hardware
from fluxbooth.job.doctor.results import FAIL, OK, SKIP, WARN, CheckResult
from fluxbooth.messages import format_bytes

RUNTIME_PROBE_TIMEOUT_SECONDS = 300
# An op build's lock (torch.utils.file_baton) older than this was left by a build that was killed: building
# every host op DeepSpeed loads takes minutes on two cores, and every later load waits on a lock forever.
STALE_OP_LOCK_SECONDS = 30 * 60


def run_runtime_probe(
    config_dir: Path, env: Mapping[str, str], *, need_cpu_adam: bool, need_aio: bool, build_ops: bool, timeout: int
) -> dict[str, Any]:
    arguments = json.dumps(
        {"config_dir": str(config_dir), "need_cpu_adam": need_cpu_adam, "need_aio": need_aio, "build_ops": build_ops}
    )
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "fluxbooth.job.doctor", "--runtime-probe", arguments],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env),
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired:
        return {"probe_error": f"the runtime probe did not finish within {timeout} s"}
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith("{"):
            try:
                probe: dict[str, Any] = json.loads(line)
                return probe
            except ValueError:
                break
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
    return {"probe_error": f"the runtime probe exited {completed.returncode}: {' | '.join(tail)[:400]}"}


def check_gpu(hardware: Hardware, report: Mapping[str, Any], allow_cpu: bool) -> CheckResult:
    if hardware.gpus and report.get("cuda_available"):
        names = ", ".join(sorted({gpu.name for gpu in hardware.gpus}))
        bf16 = "bf16 supported" if report.get("cuda_bf16") else "no bf16 (fp16 only; FLUX may overflow)"
        return CheckResult(
            "CUDA",
            OK if report.get("cuda_bf16") else WARN,
            f"{report.get('cuda_device_count')}x {names}, {format_bytes(hardware.gpu_memory_bytes)} each, "
            f"CUDA {report.get('cuda_version')}, {bf16}",
        )
    if hardware.gpus:
        return CheckResult(
            "CUDA",
            FAIL,
            f"nvidia-smi sees {hardware.gpu_count} GPU(s) but torch cannot use CUDA "
            f"(torch {report.get('torch', '?')}, CUDA build {report.get('cuda_version')}); install a CUDA build of torch",
        )
    why = "; ".join(hardware.notes) or "no GPU found"
    if allow_cpu:
        return CheckResult(
            "CUDA", SKIP, f"{why}; --allow-cpu: training runs on DeepSpeed's CPU accelerator (tiny models only)"
        )
    return CheckResult("CUDA", FAIL, f"{why}; run on a GPU worker, or pass --allow-cpu for CPU-only checks")


def check_deepspeed(report: Mapping[str, Any], plan: Any) -> list[CheckResult]:
    if "torch_error" in report or "probe_error" in report:
        detail = report.get("torch_error") or report.get("probe_error")
        return [CheckResult("DeepSpeed", FAIL, f"could not import torch: {detail}")]
    if "deepspeed_error" in report:
        return [CheckResult("DeepSpeed", FAIL, f"import failed: {report['deepspeed_error']}; pip install deepspeed")]
    results = []
    accelerator = report.get("ds_accelerator")
    status = OK if accelerator == plan.accelerator else FAIL
    results.append(
        CheckResult(
            "DeepSpeed",
            status,
            f"deepspeed {report.get('deepspeed')} on torch {report.get('torch')}, accelerator {accelerator!r}"
            + ("" if status == OK else f" but the plan needs {plan.accelerator!r}; check DS_ACCELERATOR"),
        )
    )
    for op_name, entry in sorted(report.get("ops", {}).items()):
        if not entry.get("needed"):
            state = "compatible" if entry.get("compatible") else "not compatible"
            results.append(CheckResult(f"op {op_name}", SKIP, f"not needed by the plan ({state})"))
            continue
        if entry.get("error"):
            results.append(CheckResult(f"op {op_name}", FAIL, entry["error"]))
        elif not entry.get("compatible"):
            results.append(CheckResult(f"op {op_name}", FAIL, "not compatible with this system (see ds_report)"))
        elif entry.get("loaded"):
            how = "pre-built" if entry.get("installed") else "JIT-built and cached"
            results.append(CheckResult(f"op {op_name}", OK, f"{how}, loads"))
        else:
            results.append(
                CheckResult(
                    f"op {op_name}",
                    WARN,
                    "compatible but not built: the first job compiles it (minutes); build it now with "
                    "`python -m fluxbooth doctor --build-ops` or pre-build it in the image",
                )
            )
    return results


def check_accelerate(report: Mapping[str, Any], plan: Any) -> CheckResult:
    if "accelerate_error" in report:
        return CheckResult("accelerate", FAIL, report["accelerate_error"])
    if not report.get("accelerate_deepspeed_available"):
        return CheckResult("accelerate", FAIL, f"accelerate {report.get('accelerate')} cannot find DeepSpeed")
    stages = (report.get("accelerate_zero_stage"), report.get("deepspeed_zero_stage"))
    if plan.use_deepspeed and stages != (plan.zero_stage, plan.zero_stage):
        return CheckResult(
            "accelerate",
            FAIL,
            f"the written DeepSpeed config reads back as stage {stages}, the plan says {plan.zero_stage}",
        )
    return CheckResult(
        "accelerate",
        OK,
        f"accelerate {report.get('accelerate')} with DeepSpeed; the written config loads (ZeRO-{plan.zero_stage})",
    )


def clear_stale_op_locks(extensions: Path, now: float) -> CheckResult:
    """Remove the op-build locks (`<TORCH_EXTENSIONS_DIR>/<op>/lock`) older than STALE_OP_LOCK_SECONDS, naming
    each: a build killed mid-way leaves one, and every later load of that op would wait on it forever."""
    locks = sorted({*extensions.glob("*/lock"), *extensions.glob("*/*/lock")})
    stale = [lock for lock in locks if now - lock.stat().st_mtime > STALE_OP_LOCK_SECONDS]
    if not stale:
        return CheckResult(
            "op build locks", OK, f"no lock older than {STALE_OP_LOCK_SECONDS // 60} min in {extensions}"
        )
    try:
        for lock in stale:
            lock.unlink(missing_ok=True)
    except OSError as error:
        return CheckResult(
            "op build locks",
            FAIL,
            f"cannot remove the stale op-build lock {error.filename}: "
            f"{error.strerror}; delete it or point TORCH_EXTENSIONS_DIR at a writable folder",
        )
    return CheckResult(
        "op build locks",
        WARN,
        f"removed {len(stale)} op-build lock(s) older than "
        f"{STALE_OP_LOCK_SECONDS // 60} min, left by a killed build: {', '.join(map(str, stale))}",
    )
