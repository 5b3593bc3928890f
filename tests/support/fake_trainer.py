"""A stand-in for `accelerate launch -m fluxbooth.train`, for faults the real trainer cannot produce on demand.

`fake_trainer_command(tmp_path, mode)` writes a script and returns the command that runs it. Modes:
ok, crash, cuda_oom:<spelling>, sigkill, host_oom_message, hang, hang_with_grandchild, nan, leak_secret:<ENV>, silent_exit0.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAKE_TRAINER_SOURCE = r"""
import json, os, signal, subprocess, sys, time
MARK = "FLUXBOOTH_EVENT "
def event(kind, **fields):
    print(MARK + json.dumps({"event": kind, **fields}), flush=True)
mode = sys.argv[1]
out = sys.argv[2]
event("stage", stage="train")
for step in (1, 2):
    event("step", step=step, total=2, loss=0.5 / step, lr=1e-4, seconds_per_step=0.01)
if mode == "ok":
    os.makedirs(os.path.join(out, "transformer"), exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    with open(os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"), "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header + b"\x00" * 8)
    with open(os.path.join(out, "transformer", "config.json"), "w") as f:
        f.write("{}")
    event("done", metrics={"steps": 2, "final_loss": 0.25, "optimizer": "FakeAdam"},
          artifacts=[{"name": "transformer", "path": "transformer", "kind": "diffusers"}])
elif mode == "crash":
    print("Traceback (most recent call last):", flush=True)
    print('  File "train.py", line 1, in <module>', flush=True)
    print("RuntimeError: something broke in the trainer", flush=True)
    sys.exit(1)
elif mode.startswith("cuda_oom:"):
    print("Traceback (most recent call last):", flush=True)
    print(mode.split(":", 1)[1], flush=True)
    sys.exit(1)
elif mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
elif mode == "host_oom_message":
    print("RuntimeError: [enforce fail at alloc_cpu.cpp:116] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 1000000000000 bytes.", flush=True)
    sys.exit(1)
elif mode == "hang":
    time.sleep(3600)
elif mode == "hang_with_grandchild":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    with open(os.path.join(out, "grandchild.pid"), "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)
elif mode == "nan":
    event("error", code="nan_loss", message="loss became nan at step 3; lower learning_rate")
    sys.exit(3)
elif mode.startswith("leak_secret:"):
    print("token is " + os.environ.get(mode.split(":", 1)[1], "<unset>"), flush=True)
    sys.exit(1)
elif mode == "silent_exit0":
    sys.exit(0)
"""


def fake_trainer_command(directory: Path, mode: str, output_dir: Path | None = None) -> list[str]:
    script = directory / "fake_trainer.py"
    script.write_text(FAKE_TRAINER_SOURCE)
    out = output_dir or directory
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, str(script), mode, str(out)]
