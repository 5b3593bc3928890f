"""`python -m fluxbooth plan --runpod-gpu all`: one job planned on every RunPod serverless GPU type the planner
knows, twice each: on a first job (the base model's download counted) and with the model cached on the worker.
One row a type: the strategy, and for each case whether the worker trains it or refuses it (and why, in a few
words), the whole job's minutes and its price at RunPod's flex rate. `--json` gives the same rows."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any, TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.cli.plan.machine import apply_runpod_preset
from fluxbooth.cli.plan.report import SizedJob, job_report, sized_job
from fluxbooth.cli.plan.table import IMAGES_SOURCE_WORDS
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import format_bytes
from fluxbooth.plan.runpod_gpus import RUNPOD_GPUS, RunpodGpu

ALL_GPUS = "all"
# The two cases of each row: (key, --cached).
CASES = (("first_job", False), ("cached_model", True))
# Flags that describe one card: meaningless beside every type.
ONE_CARD_FLAGS = (("--gpu-memory", "gpu_memory"), ("--gpu-name", "gpu_name"), ("--cached", "cached"))
# The deadline check's warnings (plan.checks.deadline_check): the job starts, but close to its deadline.
# What the table's words mean, under it.
LEGEND = (
    "min: the whole job (download, training, samples, scoring, upload); USD: at RunPod's flex price per second (-: refused",
    "or unpublished). close: warned it may not finish in time. refused: before any download. streamed: the frozen base's",
    "blocks live in host RAM and stream to the GPU. Predictions, not measurements; host RAM and vCPUs are assumed.",
)
CLOSE_TO_DEADLINE = ("steps: the estimated run time", "likeness: the job deadline leaves")


def _refuse_one_card_flags(arguments: argparse.Namespace) -> None:
    given = [flag for flag, name in ONE_CARD_FLAGS if getattr(arguments, name)]
    if given:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"--runpod-gpu all plans every type, each with its own memory and name, on a first job and with the "
            f"model cached: drop {', '.join(given)}",
        )


def _fastest(report: dict[str, Any]) -> dict[str, Any] | None:
    """The candidate the planner picks (plan.candidates.pick): the fastest that honours the request and fits."""
    eligible = [c for c in report["candidates"] if c["honours_request"] and c["fits"]]
    return min(eligible, key=lambda candidate: candidate["seconds_per_step"]) if eligible else None


def _strategy(candidate: dict[str, Any] | None) -> str:
    if candidate is None:
        return "-"
    if candidate["training_type"] == "full":
        text = "full, fused Adafactor" if candidate["fused_backward_pass"] else "full"
    else:
        text = f"{candidate['base_precision']} base" + (" streamed" if candidate["block_swap"] else "")
    text += f", ZeRO-{candidate['zero_stage']}" if candidate["use_deepspeed"] else ", no DeepSpeed"
    if candidate["offload_optimizer"] != "none":
        text += f", optimizer on {candidate['offload_optimizer']}"
    return text


def _answer(report: dict[str, Any]) -> str:
    """The worker's answer in a few words."""
    if report["plan"] is not None:
        close = any(warning.startswith(CLOSE_TO_DEADLINE) for warning in report["warnings"])
        return "trains (close)" if close else "trains"
    details = report["error"].get("details", {})
    if "steps_that_fit" in details:
        return f"refused: {details['steps_that_fit']} steps fit"
    reasons = " ".join(c["reason"] for c in report["candidates"] if c["honours_request"])
    short = [
        word
        for word, needle in (("GPU memory", "per GPU"), ("host RAM", "host RAM"), ("disk", "disk"))
        if needle in reasons
    ]
    return f"refused: too little {' or '.join(short) or 'memory'}"


def _case(report: dict[str, Any]) -> dict[str, Any]:
    fastest = _fastest(report)
    return {
        "trains": report["plan"] is not None,
        "answer": _answer(report),
        "minutes": round(fastest["total_seconds"] / 60, 1) if fastest is not None else None,
        "cost": report["cost"]["predicted_cost"] if "cost" in report else None,
        "download_bytes": report["base_model_download_bytes"],
    }


def gpu_reports(
    job: SizedJob, arguments: argparse.Namespace, environ: Mapping[str, str], gpu: RunpodGpu
) -> list[dict[str, Any]]:
    """plan's reports for the job on a worker with `gpu`, one a case (CASES): the download counted, then cached."""
    reports = []
    for _, cached in CASES:
        on_gpu = argparse.Namespace(**{**vars(arguments), "runpod_gpu": gpu.name, "cached": cached})
        reports.append(job_report(job, on_gpu, environ, apply_runpod_preset(on_gpu)))
    return reports


def gpu_row(gpu: RunpodGpu, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One type's row: the strategy the planner picks there, and each case's answer, minutes and price."""
    row: dict[str, Any] = {"gpu": gpu.name, "pool": gpu.pool, "memory_gib": gpu.memory_gib}
    row["strategy"] = _strategy(_fastest(reports[-1]))
    row.update({key: _case(report) for (key, _), report in zip(CASES, reports, strict=True)})
    return row


def every_gpu(arguments: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """What `--runpod-gpu all --json` prints: the job, then one row a RunPod type."""
    _refuse_one_card_flags(arguments)
    job = sized_job(arguments, environ)
    reports = {gpu.name: gpu_reports(job, arguments, environ, gpu) for gpu in RUNPOD_GPUS}
    first = reports[RUNPOD_GPUS[0].name][0]
    return {
        "model": first["model"]["name"],
        "job": first["job"],
        "instance_images": first["instance_images"],
        "instance_images_source": first["instance_images_source"],
        "deadline_seconds": first["deadline_seconds"],
        "deadline_source": first["deadline_source"],
        "download_bytes": first["base_model_download_bytes"],
        "rows": [gpu_row(gpu, reports[gpu.name]) for gpu in RUNPOD_GPUS],
    }


def _cells(case: dict[str, Any]) -> tuple[str, str, str]:
    minutes = f"{case['minutes']:.0f}" if case["minutes"] is not None else "-"
    cost = f"{case['cost']:.2f}" if case["trains"] and case["cost"] is not None else "-"
    return case["answer"], minutes, cost


def every_gpu_table(answer: dict[str, Any]) -> str:
    """What `--runpod-gpu all` prints: the job, then one aligned row a type."""
    job = answer["job"]
    width, height = job["resolution"]
    kind = job["training_type"] + (f" rank {job['lora_rank']}" if job["training_type"] == "lora" else "")
    lines = [
        f"job       {answer['model']}, {kind}, {job['steps']} steps at {width}x{height}, {answer['instance_images']} "
        f"images ({IMAGES_SOURCE_WORDS.get(answer['instance_images_source'], answer['instance_images_source'])})",
        f"deadline  {answer['deadline_seconds'] / 60:.0f} min ({answer['deadline_source']})",
        f"first job the base model's {format_bytes(answer['download_bytes'])} download counted; cached model: already "
        "on the worker",
        "",
    ]
    rows = [("GPU type", "pool", "memory", "strategy", "first job", "min", "USD", "cached model", "min", "USD")]
    for row in answer["rows"]:
        rows.append(
            (
                row["gpu"],
                row["pool"],
                f"{row['memory_gib']} GB",
                row["strategy"],
                *_cells(row["first_job"]),
                *_cells(row["cached_model"]),
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*lines, "", *LEGEND]) + "\n"


def run_every_gpu(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    """Exits 0 when some type trains the job (on a first job or cached), 1 when every one refuses it."""
    answer = every_gpu(arguments, environ)
    out.write(json.dumps(answer, indent=2) + "\n" if arguments.json else every_gpu_table(answer))
    trains = any(row[key]["trains"] for row in answer["rows"] for key, _ in CASES)
    return EXIT_OK if trains else EXIT_FAILED
