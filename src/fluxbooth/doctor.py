"""`python -m fluxbooth doctor`: is this machine ready to train?

Everything the reference guide's test_deepspeed.py checked (DeepSpeed installed with compatible
ops, accelerate's DeepSpeed support, CUDA and bf16, config files written and re-read, the
environment the plan sets), plus host RAM, disk, the base model's presence and the bucket.

torch, DeepSpeed and accelerate are only ever imported in a child process (`python -m
fluxbooth.doctor --runtime-probe ...`), run with the environment the plan gives the trainer: a
broken CUDA install cannot take the doctor down with it, and the probe sees what the trainer
will see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from botocore.exceptions import BotoCoreError, ClientError

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.names import GUIDANCE_DISTILLED_SAMPLING
from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.hardware import GIB, Hardware, format_bytes, probe_hardware
from fluxbooth.launch_files import DEBUG_ONLY_ENV, child_environment, write_launch_files
from fluxbooth.model_source import ModelPlaces, how_to_provide, local_model_folder, locate_hub_model
from fluxbooth.plan import JobShape, Plan, choose_plan, model_size
from fluxbooth.redaction import Redactor
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from fluxbooth.storage import S3Store, storage_problem

OK = "ok"
WARN = "warn"
FAIL = "fail"
SKIP = "skip"

RUNTIME_PROBE_TIMEOUT_SECONDS = 300
MIN_HOST_BYTES = 2 * GIB
MIN_DISK_BYTES = 2 * GIB
BUCKET_TIMEOUT_SECONDS = 10.0
# An op build's lock (torch.utils.file_baton) older than this was left by a build that was killed: building
# every host op DeepSpeed loads takes minutes on two cores, and every later load waits on a lock forever.
STALE_OP_LOCK_SECONDS = 30 * 60


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail}


@dataclass(frozen=True)
class DoctorOptions:
    allow_cpu: bool = False
    build_ops: bool = False
    probe_timeout_seconds: int = RUNTIME_PROBE_TIMEOUT_SECONDS


# =================================================================================================
# The runtime probe (child process: the only place torch is imported)
# =================================================================================================


def _runtime_probe(config_dir: str, need_cpu_adam: bool, need_aio: bool, build_ops: bool) -> dict[str, Any]:
    """Runs in the child. Returns plain data; never raises (failures become entries)."""
    report: dict[str, Any] = {}
    try:
        import torch  # only here, in the probe's child process (see the module's docstring)

        report["torch"] = torch.__version__
        report["cuda_available"] = bool(torch.cuda.is_available())
        report["cuda_device_count"] = torch.cuda.device_count() if report["cuda_available"] else 0
        report["cuda_bf16"] = bool(torch.cuda.is_bf16_supported()) if report["cuda_available"] else False
        report["cuda_version"] = torch.version.cuda
    except Exception as error:  # noqa: BLE001 - a broken install is a finding, not a crash
        report["torch_error"] = f"{type(error).__name__}: {error}"[:300]
        return report
    try:
        import deepspeed  # child process only, like torch
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops

        report["deepspeed"] = deepspeed.__version__
        accelerator = get_accelerator()
        report["ds_accelerator"] = accelerator._name
        ops: dict[str, dict[str, Any]] = {}
        wanted = [("cpu_adam", "CPUAdamBuilder", need_cpu_adam), ("async_io", "AsyncIOBuilder", need_aio)]
        for op_name, builder_name, needed in wanted:
            entry: dict[str, Any] = {"needed": needed}
            try:
                builder = accelerator.create_op_builder(builder_name)
                if builder is None:
                    entry["compatible"] = False
                    entry["error"] = f"the {accelerator._name} accelerator has no {op_name} op"
                else:
                    entry["compatible"] = bool(builder.is_compatible(verbose=False))
                    entry["installed"] = bool(installed_ops.get(op_name)) and accelerator_name == accelerator._name
                    extensions = Path(os.environ.get("TORCH_EXTENSIONS_DIR", ""))
                    entry["jit_cached"] = bool(os.environ.get("TORCH_EXTENSIONS_DIR")) and any(
                        extensions.glob(f"**/{builder.name}*.so")
                    )
                    if needed and entry["compatible"] and (entry["installed"] or entry["jit_cached"] or build_ops):
                        builder.load(verbose=False)
                        entry["loaded"] = True
            except Exception as error:  # noqa: BLE001
                entry["error"] = f"{type(error).__name__}: {error}"[:300]
            ops[op_name] = entry
        report["ops"] = ops
    except Exception as error:  # noqa: BLE001
        report["deepspeed_error"] = f"{type(error).__name__}: {error}"[:300]
    try:
        import accelerate  # child process only, like torch
        from accelerate.utils import DeepSpeedPlugin, is_deepspeed_available

        report["accelerate"] = accelerate.__version__
        report["accelerate_deepspeed_available"] = bool(is_deepspeed_available())
        ds_path = Path(config_dir) / "ds_config.json"
        if ds_path.is_file():
            plugin = DeepSpeedPlugin(hf_ds_config=str(ds_path))
            report["accelerate_zero_stage"] = plugin.zero_stage
            from deepspeed.runtime.config import DeepSpeedConfig  # child process only, like torch

            parsed = DeepSpeedConfig(str(ds_path))
            report["deepspeed_zero_stage"] = parsed.zero_optimization_stage
    except Exception as error:  # noqa: BLE001
        report["accelerate_error"] = f"{type(error).__name__}: {error}"[:300]
    return report


def run_runtime_probe(
    config_dir: Path, env: Mapping[str, str], *, need_cpu_adam: bool, need_aio: bool, build_ops: bool, timeout: int
) -> dict[str, Any]:
    arguments = json.dumps(
        {"config_dir": str(config_dir), "need_cpu_adam": need_cpu_adam, "need_aio": need_aio, "build_ops": build_ops}
    )
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "fluxbooth.doctor", "--runtime-probe", arguments],
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
                return json.loads(line)
            except ValueError:
                break
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-3:]
    return {"probe_error": f"the runtime probe exited {completed.returncode}: {' | '.join(tail)[:400]}"}


# =================================================================================================
# Checks (parent process: no torch)
# =================================================================================================


def _reference_plan(hardware: Hardware, settings: WorkerSettings) -> tuple[Any, str]:
    """The plan a default job would get here, else the guide's ZeRO-2 CPU-offload plan."""
    job = JobShape(resolution=(512, 512) if hardware.accelerator == "cpu" else (1024, 1024), steps=10)
    try:
        model = model_size(_resolved_base_model(settings) or settings.default_base_model)
        return choose_plan(job, hardware, model), "the plan a default job gets on this machine"
    except FluxboothError as error:
        why = (
            "the default job does not fit here"
            if error.code is ErrorCode.DOES_NOT_FIT
            else "the base model cannot be sized here"
        )
        on_cpu = hardware.accelerator == "cpu"
        fallback = Plan(
            accelerator="cpu" if on_cpu else "cuda",
            num_processes=1 if on_cpu else max(1, hardware.gpu_count),
            training_type="full",
            use_deepspeed=True,
            zero_stage=2,
            offload_optimizer="cpu",
            offload_param="none",
            mixed_precision="bf16",
            gradient_checkpointing=True,
            optimizer="DeepSpeedCPUAdam",
            predicted_gpu_bytes=0,
            predicted_host_bytes=0,
            predicted_disk_bytes=0,
        )
        return fallback, f"the guide's ZeRO-2 CPU-offload plan ({why})"


def _resolved_base_model(settings: WorkerSettings) -> str | None:
    """A local folder for the configured base model, or None when it is not on this machine."""
    name = settings.default_base_model
    if name == TINY_MODEL_NAME:
        return None
    folder = local_model_folder(name, None, settings.environ)
    return str(folder) if folder is not None else None


def check_base_model(settings: WorkerSettings) -> CheckResult:
    name = settings.default_base_model
    if name == TINY_MODEL_NAME:
        return CheckResult("base model", OK, f"{name}: built on demand from code, nothing to download")
    folder = _resolved_base_model(settings)
    if folder is None and name.startswith("/"):
        return CheckResult("base model", FAIL, f"{name} is not on this machine (no transformer/config.json there)")
    if folder is None:
        places = ModelPlaces.from_environ(settings.environ)
        looked = "; ".join(look.describe() for look in locate_hub_model(name, None, places)[1])
        if places.offline:
            return CheckResult("base model", FAIL, f"{name} is not on this machine and HF_HUB_OFFLINE=1. Looked in: "
                               f"{looked}. {how_to_provide(name)}")
        return CheckResult("base model", WARN, f"{name} is not on this machine: the first job downloads it into "
                           f"{places.hub_cache} (HF_TOKEN for gated models). Looked in: {looked}")
    weights = list((Path(folder) / "transformer").glob("*.safetensors"))
    if not weights:
        return CheckResult("base model", FAIL, f"{folder}/transformer has config.json but no .safetensors weights")
    size = sum(path.stat().st_size for path in weights)
    return CheckResult("base model", OK, f"{folder}: transformer weights {format_bytes(size)}")


def check_host_memory(hardware: Hardware, plan: Any) -> CheckResult:
    limit = (
        f" (cgroup limit {format_bytes(hardware.cgroup_memory_limit_bytes)})"
        if hardware.cgroup_memory_limit_bytes
        else ""
    )
    detail = f"{format_bytes(hardware.host_available_bytes)} available of {format_bytes(hardware.host_total_bytes)}{limit}"
    if hardware.host_available_bytes < MIN_HOST_BYTES:
        return CheckResult("host RAM", FAIL, detail + f"; at least {format_bytes(MIN_HOST_BYTES)} is needed")
    if plan.predicted_host_bytes and plan.predicted_host_bytes > hardware.host_available_bytes:
        return CheckResult("host RAM", WARN, detail + f"; the reference plan needs ≈{format_bytes(plan.predicted_host_bytes)}")
    return CheckResult("host RAM", OK, detail)


def check_disk(hardware: Hardware) -> CheckResult:
    detail = f"{format_bytes(hardware.disk_free_bytes)} free at {hardware.work_dir}"
    if hardware.nvme_path:
        detail += f"; {format_bytes(hardware.nvme_free_bytes or 0)} free at the offload path {hardware.nvme_path}"
    if hardware.disk_free_bytes < MIN_DISK_BYTES:
        return CheckResult("disk", FAIL, detail + f"; at least {format_bytes(MIN_DISK_BYTES)} is needed")
    return CheckResult("disk", OK, detail)


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
        return CheckResult("CUDA", SKIP, f"{why}; --allow-cpu: training runs on DeepSpeed's CPU accelerator (tiny models only)")
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
        "accelerate", OK, f"accelerate {report.get('accelerate')} with DeepSpeed; the written config loads (ZeRO-{plan.zero_stage})"
    )


def write_and_reread_configs(plan: Any, job_dir: Path, work_dir: Path) -> CheckResult:
    """Write the launch files a job would get and read them back as accelerate and DeepSpeed would."""

    trainer = TrainerConfig(
        base_model="/models/flux",
        instance_dir=str(job_dir / "data" / "instance"),
        class_dir=None,
        output_dir=str(job_dir / "output"),
        cache_dir=str(job_dir / "cache"),
        instance_prompt="a photo of sks dog",
        class_prompt=None,
        with_prior_preservation=False,
        prior_loss_weight=1.0,
        num_class_images=0,
        resolution=Resolution(fixed=(512, 512)),
        training_type=plan.training_type,
        steps=10,
        learning_rate=1e-5,
        batch_size=1,
        gradient_accumulation_steps=1,
        mixed_precision=plan.mixed_precision,
        gradient_checkpointing=plan.gradient_checkpointing,
        seed=0,
        zero_stage=plan.zero_stage,
        offload_optimizer=plan.offload_optimizer,
        offload_param=plan.offload_param,
        max_sequence_length=GUIDANCE_DISTILLED_SAMPLING.max_sequence_length,
        validation_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
        validation_guidance_scale=GUIDANCE_DISTILLED_SAMPLING.guidance_scale,
        class_image_inference_steps=GUIDANCE_DISTILLED_SAMPLING.inference_steps,
    )
    try:
        files = write_launch_files(job_dir, plan, trainer)
        accelerate = yaml.safe_load(files.accelerate_config.read_text())
        reread = TrainerConfig.from_dict(json.loads(files.trainer_config.read_text()))
        problems = []
        if reread != trainer:
            problems.append("train.json does not read back equal")
        if plan.use_deepspeed:
            deepspeed = json.loads(files.deepspeed_config.read_text())
            # Under DeepSpeed the precision lives in the DeepSpeed JSON only.
            for precision in ("bf16", "fp16"):
                enabled = bool(deepspeed.get(precision, {}).get("enabled"))
                if enabled != (plan.mixed_precision == precision):
                    problems.append(f"ds_config.json {precision}.enabled={enabled}, the plan says {plan.mixed_precision}")
            if deepspeed["zero_optimization"]["stage"] != plan.zero_stage:
                problems.append(f"ZeRO stage {deepspeed['zero_optimization']['stage']}")
            section = accelerate.get("deepspeed_config", {})
            if accelerate.get("distributed_type") != "DEEPSPEED" or section.get("deepspeed_config_file") != str(
                files.deepspeed_config
            ):
                problems.append("accelerate.yaml does not point at ds_config.json")
        elif accelerate.get("mixed_precision") != plan.mixed_precision:
            problems.append(f"accelerate.yaml mixed_precision {accelerate.get('mixed_precision')!r}, the plan says {plan.mixed_precision}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return CheckResult("config files", FAIL, f"writing or reading them failed: {type(error).__name__}: {error}")
    if problems:
        return CheckResult("config files", FAIL, "; ".join(problems))
    names = ", ".join(path.name for path in (files.deepspeed_config, files.accelerate_config, files.trainer_config) if path)
    return CheckResult("config files", OK, f"{names} written and re-read in a temporary directory")


def check_environment(plan: Any, child_env: Mapping[str, str]) -> CheckResult:
    problems = []
    if child_env.get("DS_ACCELERATOR") != plan.accelerator:
        problems.append(f"DS_ACCELERATOR={child_env.get('DS_ACCELERATOR')!r}")
    for name in DEBUG_ONLY_ENV:
        if name in child_env:
            problems.append(f"{name} is set outside debug mode (it serialises the GPU)")
    if not child_env.get("TORCH_EXTENSIONS_DIR"):
        problems.append("TORCH_EXTENSIONS_DIR is not set")
    if problems:
        return CheckResult("environment", FAIL, "; ".join(problems))
    shown = {name: child_env[name] for name in ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR") if name in child_env}
    return CheckResult("environment", OK, ", ".join(f"{name}={value}" for name, value in shown.items()))


def check_bucket(settings: WorkerSettings) -> CheckResult:
    """HEAD the bucket with the worker's credentials; the message never carries a credential."""
    bucket = settings.bucket
    if bucket is None:
    
        problem = storage_problem(settings)
        if problem is not None:
            return CheckResult("object storage", FAIL, problem)
        return CheckResult("object storage", SKIP, f"no bucket (BUCKET_ENDPOINT_URL): artifacts go to {settings.output_dir}")

    host = urlsplit(bucket.endpoint_url).hostname if bucket.endpoint_url else "AWS S3"
    where = f"s3://{bucket.bucket} at {host}"
    redact = Redactor(settings.secret_values)
    try:
        store = S3Store(
            bucket,
            "",
            total_attempts=2,
            connect_timeout_seconds=BUCKET_TIMEOUT_SECONDS,
            read_timeout_seconds=BUCKET_TIMEOUT_SECONDS,
        )
        store.client.head_bucket(Bucket=bucket.bucket)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "?")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        hint = {
            "403": "the key cannot access this bucket; check BUCKET_ACCESS_KEY_ID/BUCKET_SECRET_ACCESS_KEY",
            "404": "no such bucket; check the bucket named in BUCKET_ENDPOINT_URL (or BUCKET_NAME)",
        }.get(str(status), "check BUCKET_ENDPOINT_URL and the bucket settings")
        return CheckResult("object storage", FAIL, redact(f"HEAD {where} failed: {status} {code}; {hint}"))
    except (BotoCoreError, FluxboothError, ValueError) as error:
        return CheckResult("object storage", FAIL, redact(f"HEAD {where} failed: {type(error).__name__}; check BUCKET_ENDPOINT_URL"))
    return CheckResult("object storage", OK, f"HEAD {where}: reachable")


def clear_stale_op_locks(extensions: Path, now: float) -> CheckResult:
    """Remove the op-build locks (`<TORCH_EXTENSIONS_DIR>/<op>/lock`) older than STALE_OP_LOCK_SECONDS, naming
    each: a build killed mid-way leaves one, and every later load of that op would wait on it forever."""
    locks = sorted({*extensions.glob("*/lock"), *extensions.glob("*/*/lock")})
    stale = [lock for lock in locks if now - lock.stat().st_mtime > STALE_OP_LOCK_SECONDS]
    if not stale:
        return CheckResult("op build locks", OK, f"no lock older than {STALE_OP_LOCK_SECONDS // 60} min in {extensions}")
    try:
        for lock in stale:
            lock.unlink(missing_ok=True)
    except OSError as error:
        return CheckResult("op build locks", FAIL, f"cannot remove the stale op-build lock {error.filename}: "
                           f"{error.strerror}; delete it or point TORCH_EXTENSIONS_DIR at a writable folder")
    return CheckResult("op build locks", WARN, f"removed {len(stale)} op-build lock(s) older than "
                       f"{STALE_OP_LOCK_SECONDS // 60} min, left by a killed build: {', '.join(map(str, stale))}")


# =================================================================================================
# Entry point
# =================================================================================================


def run_doctor(
    environ: Mapping[str, str],
    options: DoctorOptions,
    *,
    probe: Callable[..., dict[str, Any]] = run_runtime_probe,
) -> list[CheckResult]:
    """Every check, in the order a person reads them. `probe` is the child-process runner."""
    settings = WorkerSettings.from_environ(environ)
    work_dir = settings.work_root
    hardware = probe_hardware(work_dir, environ)
    plan, plan_source = _reference_plan(hardware, settings)
    extensions = Path(environ.get("TORCH_EXTENSIONS_DIR") or settings.cache_dir / "torch_extensions")
    child_env = child_environment(
        plan, environ, cpu_count=hardware.cpu_count, torch_extensions_dir=extensions, debug=False
    )
    results = [
        CheckResult(
            "plan",
            OK,
            f"{plan_source}: ZeRO-{plan.zero_stage}, offload optimizer {plan.offload_optimizer}, "
            f"parameters {plan.offload_param}, {plan.mixed_precision}, accelerator {plan.accelerator}",
        )
    ]
    # Before the probe, which loads the ops and would wait on a stale lock.
    results.append(clear_stale_op_locks(extensions, time.time()))
    with tempfile.TemporaryDirectory(prefix="fluxbooth-doctor-") as temporary:
        job_dir = Path(temporary)
        results.append(write_and_reread_configs(plan, job_dir, work_dir))
        results.append(check_environment(plan, child_env))
        report = probe(
            job_dir / "config",
            child_env,
            need_cpu_adam=plan.offload_optimizer != "none",
            need_aio="nvme" in (plan.offload_optimizer, plan.offload_param),
            build_ops=options.build_ops,
            timeout=options.probe_timeout_seconds,
        )
    results.extend(check_deepspeed(report, plan))
    results.append(check_accelerate(report, plan) if "deepspeed_error" not in report else CheckResult(
        "accelerate", FAIL, "skipped: DeepSpeed did not import"))
    results.append(check_gpu(hardware, report, options.allow_cpu))
    results.append(check_host_memory(hardware, plan))
    results.append(check_disk(hardware))
    results.append(check_base_model(settings))
    results.append(check_bucket(settings))
    return results


def doctor_passed(results: list[CheckResult]) -> bool:
    return all(result.status != FAIL for result in results)


# Not a reason to stop a worker at start: a missing base model may still be downloaded by the first job
# (which refuses in seconds, naming where it looked, when it cannot be).
NOT_CHECKED_AT_WORKER_START = frozenset({"base model"})


def worker_start_checks(
    environ: Mapping[str, str], *, probe: Callable[..., dict[str, Any]] = run_runtime_probe
) -> list[CheckResult]:
    """The doctor's checks that show a broken worker before it takes a job: its settings and bucket, torch,
    CUDA when the machine has GPUs, DeepSpeed and its ops, accelerate, host RAM and disk. A machine without
    any GPU is not failed here (the planner refuses its jobs, naming why)."""
    try:
        WorkerSettings.from_environ(environ)
    except ValueError as error:
        return [CheckResult("worker settings", FAIL, f"{error}; fix the endpoint's environment variables")]
    results = run_doctor(environ, DoctorOptions(allow_cpu=True), probe=probe)
    return [result for result in results if result.name not in NOT_CHECKED_AT_WORKER_START]


def _child_main(arguments: list[str]) -> int:
    options = json.loads(arguments[0])
    report = _runtime_probe(options["config_dir"], options["need_cpu_adam"], options["need_aio"], options["build_ops"])
    # The last line of stdout is the report; libraries may print above it.
    sys.stdout.write("\n" + json.dumps(report) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--runtime-probe":
        raise SystemExit(_child_main(sys.argv[2:]))
    raise SystemExit("usage: python -m fluxbooth doctor (this module's own entry point is internal)")
