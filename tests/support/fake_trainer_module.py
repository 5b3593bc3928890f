"""A fault-injecting stand-in for `fluxbooth.train`, run by the REAL `accelerate launch`.

Select it with `FLUXBOOTH_TRAINER_MODULE=tests.support.fake_trainer_module` (and PYTHONPATH at the repo root).
It reads the train.json the worker wrote and behaves as the job's `instance_prompt` asks, so a test
drives a fault through the real request, planner, configs, launcher and classification:

    "a photo of sks dog"                       train "successfully": write weights, emit `done`
    "... fault:print_env fault:print_cmdline"  first print the environment / command lines, then go on
    "... fault:leak_hf_token"                  print HF_TOKEN's value (the worker must redact it), then go on
    "... fault:crash"                          a Python traceback, exit status 1
    "... fault:cuda_oom"                       a CUDA out-of-memory traceback, exit status 1
    "... fault:sigkill"                        SIGKILL itself (what the kernel's OOM killer does)
    "... fault:sigterm"                        SIGTERM itself (stopped from outside the worker)
    "... fault:nan"                            emit a `nan_loss` error event, exit status 3
    "... fault:hang"                           start a grandchild, print the pids, sleep forever
    "... fault:hang fault:ignore_sigterm"      the same, both ignoring SIGTERM (only SIGKILL stops them)
    "... fault:bad_weights"                    announce a truncated safetensors file

No torch: a launch costs what `accelerate launch` costs, not a model load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from fluxbooth.contract.events import event_from_payload, format_event
from fluxbooth.contract.trainer_config import TrainerConfig

FAULT_TOKEN = re.compile(r"\bfault:([a-z_]+)\b")
PIDS_LINE_PREFIX = "fake-trainer pids:"
ENV_LINE_PREFIX = "fake-trainer env "
CMDLINE_LINE_PREFIX = "fake-trainer cmdline "
CUDA_OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
WEIGHTS_FILE = "transformer/diffusion_pytorch_model.safetensors"
STEPS_BEFORE_A_FAULT = 2


def faults_in(prompt: str) -> list[str]:
    return FAULT_TOKEN.findall(prompt)


def weights_bytes(seed: int) -> bytes:
    """The safetensors file a successful run exports: one F32 tensor whose bytes depend on the seed."""
    values = (seed % 2**32).to_bytes(4, "little") * 4
    header = json.dumps({"weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(values)]}}).encode()
    return len(header).to_bytes(8, "little") + header + values


def emit(kind: str, **fields: object) -> None:
    """Any event as the real trainer prints it (from its flat JSON fields)."""
    event = event_from_payload({"event": kind, **fields})
    assert event is not None, f"not a trainer event: {kind} {fields}"
    print(format_event(event), flush=True)


def print_environment() -> None:
    for name, value in sorted(os.environ.items()):
        print(f"{ENV_LINE_PREFIX}{name}={value}", flush=True)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def print_command_lines() -> None:
    """This process's command line and its launcher's (torchrun's agent inside `accelerate launch`)."""
    for label, pid in (("self", os.getpid()), ("parent", os.getppid())):
        print(f"{CMDLINE_LINE_PREFIX}{label}: {_cmdline(pid)}", flush=True)


def export_weights(config: TrainerConfig, *, truncated: bool = False) -> None:
    target = Path(config.output_dir) / WEIGHTS_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    data = weights_bytes(config.optimisation.seed)
    target.write_bytes(data[:-3] if truncated else data)
    (target.parent / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel"}) + "\n")


def hang_with_grandchild(*, ignore_sigterm: bool) -> None:
    if ignore_sigterm:
        # An ignored signal stays ignored across fork and exec, so the grandchild ignores it too.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"{PIDS_LINE_PREFIX} launcher={os.getppid()} trainer={os.getpid()} grandchild={grandchild.pid}", flush=True)
    time.sleep(3600)


def run(config: TrainerConfig) -> int:
    faults = faults_in(config.prompts.instance_prompt)
    if "print_env" in faults:
        print_environment()
    if "print_cmdline" in faults:
        print_command_lines()
    if "leak_hf_token" in faults:
        print(f"fake-trainer HF_TOKEN is {os.environ.get('HF_TOKEN', '<unset>')}", flush=True)
    emit("stage", stage="train")
    steps = min(config.optimisation.steps, STEPS_BEFORE_A_FAULT)
    for step in range(1, steps + 1):
        emit(
            "step",
            step=step,
            total=config.optimisation.steps,
            loss=0.5 / step,
            lr=config.optimisation.learning_rate,
            seconds_per_step=0.01,
        )
    if "crash" in faults:
        print("Traceback (most recent call last):", flush=True)
        print('  File "fake_trainer_module.py", line 1, in run', flush=True)
        print("RuntimeError: the fake trainer crashed on purpose", flush=True)
        return 1
    if "cuda_oom" in faults:
        print("Traceback (most recent call last):", flush=True)
        print(CUDA_OOM_LINE, flush=True)
        return 1
    if "sigkill" in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if "sigterm" in faults:
        os.kill(os.getpid(), signal.SIGTERM)
    if "nan" in faults:
        emit("error", code="nan_loss", message=f"loss became nan at step {steps + 1}; lower learning_rate")
        return 3
    if "hang" in faults:
        hang_with_grandchild(ignore_sigterm="ignore_sigterm" in faults)
    export_weights(config, truncated="bad_weights" in faults)
    emit(
        "done",
        metrics={"steps": config.optimisation.steps, "final_loss": 0.25, "optimizer": "FakeAdam"},
        artifacts=[{"name": "transformer", "path": "transformer", "kind": "diffusers"}],
    )
    return 0


def reported_pids(log_messages: list[str]) -> dict[str, int]:
    """The pids a `fault:hang` run printed (`launcher`, `trainer`, `grandchild`), read back from the worker's log."""
    for message in log_messages:
        if PIDS_LINE_PREFIX in message:
            fields = message.split(PIDS_LINE_PREFIX, 1)[1].split()
            return {name: int(value) for name, value in (field.split("=") for field in fields)}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.fake_trainer_module")
    parser.add_argument("--config", type=Path, required=True)
    arguments = parser.parse_args(argv)
    try:
        return run(TrainerConfig.read(arguments.config))
    except Exception:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
