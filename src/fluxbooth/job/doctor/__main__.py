"""The doctor's runtime probe, run as `python -m fluxbooth.job.doctor --runtime-probe ...`: the only place the doctor
imports torch, DeepSpeed and accelerate, in a child process with the environment the plan gives the trainer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


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
