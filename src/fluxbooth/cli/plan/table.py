"""plan's answer for people: the job and machine, every candidate strategy in a table, and the chosen one's
time, cost and phases (or the worker's refusal)."""

from __future__ import annotations

from typing import Any, TextIO

from fluxbooth.cli.plan.job_request import INSTANCE_IMAGES_FLAG
from fluxbooth.messages import format_bytes

# How the table words each instance_images_source.
IMAGES_SOURCE_WORDS = {
    "zip": "counted in the request's dataset zip",
    "url": "counted in the directory of the zip at dataset_url",
    "cap": "the worker's cap, FLUXBOOTH_MAX_IMAGES",
    INSTANCE_IMAGES_FLAG: INSTANCE_IMAGES_FLAG,
}


def _count(value: int) -> str:
    for divisor, suffix in ((1e9, " B"), (1e6, " M")):
        if value >= divisor:
            return f"{value / divisor:.2f}{suffix}"
    return f"{value:,}"


# The request's gradient_checkpointing as the table says it.
CHECKPOINTING_WORDS = {True: "on", False: "off", None: "the planner's choice"}


def plan_table(report: dict[str, Any], out: TextIO) -> None:
    job = report["job"]
    model = report["model"]
    width, height = job["resolution"]
    out.write(
        f"model    {model['name']} ({_count(model['transformer_params'])} transformer parameters)\n"
        f"job      {job['training_type']}"
        + (f" rank {job['lora_rank']}, base {job['base_precision']}" if job["training_type"] == "lora" else "")
        + f", {width}x{height}, batch {job['batch_size']}, {job['mixed_precision']}, "
        f"checkpointing {CHECKPOINTING_WORDS[job['gradient_checkpointing']]}\n"
        f"machine  {report['hardware_summary']}\n"
        f"images   {report['instance_images']} ({IMAGES_SOURCE_WORDS.get(report['instance_images_source'], report['instance_images_source'])})\n"
        + (f"         {report['instance_images_note']}\n" if report.get("instance_images_note") else "")
        + (
            f"gpu      {report['gpu_name']['given']!r} read as {report['gpu_name']['matched']}\n"
            if report["gpu_name"]
            else ""
        )
        + f"deadline {report['deadline_seconds'] / 60:.0f} min ({report['deadline_source']})\n\n"
    )
    rows = _candidate_rows(report)
    header = rows[0]
    chosen = report["chosen"]
    widths = [max(len(row[index]) for row in rows) for index in range(len(header) - 1)]
    for row in rows:
        out.write(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1] + "\n"
        )
    out.write("\n* chosen   ~ an alternative (another training type or base precision), shown for comparison\n")
    if chosen is not None:
        _chosen_summary(report, out)
    else:
        # The worker's answer: refused before any download, for memory, disk or the deadline.
        out.write(f"\nrefused ({report['error']['code']}): {report['error']['message']}\n")
    for warning in report["warnings"]:
        out.write(f"warning: {warning}\n")


def _candidate_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The candidates' table, its header first: the chosen one starred, alternatives marked `~`."""
    header = (
        "",
        "type",
        "base",
        "ZeRO",
        "offload opt/param",
        "fits",
        "GPU (each)",
        "host RAM",
        "disk",
        "speed",
        "reason",
    )
    rows: list[tuple[str, ...]] = [header]
    chosen = report["chosen"]
    for candidate in report["candidates"]:
        kind = candidate["training_type"] + (f" r{candidate['lora_rank']}" if candidate["lora_rank"] else "")
        # Adafactor stepped inside the backward pass on bf16 weights, without DeepSpeed.
        kind += " fused" if candidate["fused_backward_pass"] else ""
        is_chosen = (
            chosen is not None
            and chosen["fused_backward_pass"] == candidate["fused_backward_pass"]
            and all(
                chosen[key] == candidate[key]
                for key in (
                    "training_type",
                    "base_precision",
                    "zero_stage",
                    "offload_optimizer",
                    "offload_param",
                    "block_swap",
                    "checkpoint_every",
                    "lora_rank",
                )
            )
        )
        rows.append(
            (
                "*" if is_chosen else ("" if candidate["honours_request"] else "~"),
                kind,
                candidate["base_precision"],
                str(candidate["zero_stage"]) if candidate["use_deepspeed"] else "-",
                # The frozen base streamed block by block from host RAM (block swapping) shows as "blocks".
                f"{candidate['offload_optimizer']}/{'blocks' if candidate['block_swap'] else candidate['offload_param']}",
                "yes" if candidate["fits"] else "no",
                "-" if report["accelerator"] == "cpu" else format_bytes(candidate["gpu_bytes"]),
                format_bytes(candidate["host_bytes"]),
                format_bytes(candidate["disk_bytes"]),
                f"{candidate['relative_speed']:.2f}x",
                candidate["reason"],
            )
        )
    return rows


def _chosen_summary(report: dict[str, Any], out: TextIO) -> None:
    """The chosen strategy, then each phase's peak memory and time."""
    plan = report["plan"]
    on_cpu = report["accelerator"] == "cpu"
    out.write(
        f"\nchosen: {plan['training_type']}"
        + (
            f" over {'a' if plan['base_precision'] == 'bf16' else 'an'} {plan['base_precision']} base"
            if plan["training_type"] == "lora"
            else ""
        )
        + " with "
        + ("Adafactor fused into the backward pass (bf16 weights), " if plan["fused_backward_pass"] else "")
        + (f"ZeRO-{plan['zero_stage']}" if plan["use_deepspeed"] else "no DeepSpeed")
        + f", offload optimizer {plan['offload_optimizer']}, parameters {plan['offload_param']}, "
        + (
            f"{'trained' if plan['training_type'] == 'full' else 'frozen'} blocks swapped in from host RAM, "
            if plan["block_swap"]
            else ""
        )
        + f"optimizer {plan['optimizer']}\n"
        f"time:   ≈{plan['predicted_seconds_per_step']:.2f} s/step, ≈{report['estimated_run_seconds'] / 60:.0f} min "
        f"for {report['job']['steps']} steps, ≈{(plan['predicted_total_seconds'] or 0) / 60:.0f} min for the whole job "
        "(a rough estimate, see docs/memory.md)\n"
        + (
            f"cost:   ≈{report['cost']['predicted_cost']:.2f} at {report['cost']['price_per_hour']:g} per hour "
            f"({report['cost'].get('price_source', 'FLUXBOOTH_PRICE_PER_HOUR')})\n"
            if "cost" in report
            else ""
        )
        + "\n"
    )
    rows = [("phase", "GPU peak", "host peak", "time")]
    for name, phase in plan["phases"].items():
        # Only a job that captions has the phase: every other table stays as it was.
        if name == "captioning" and not phase["seconds"]:
            continue
        rows.append(
            (
                name,
                "-" if on_cpu or not phase["gpu_bytes"] else format_bytes(phase["gpu_bytes"]),
                format_bytes(phase["host_bytes"]) if phase["host_bytes"] else "-",
                f"{phase['seconds'] / 60:.1f} min" if phase["seconds"] >= 60 else f"{phase['seconds']:.0f} s",
            )
        )
    widths = [max(len(row[index]) for row in rows) for index in range(4)]
    for row in rows:
        out.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() + "\n")
