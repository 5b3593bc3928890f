"""bench/gpu_probe.py's verdicts and its short table, from the report it gathered (pure: no torch)."""

from __future__ import annotations

from typing import Any

# The two allocator settings compared, each in its own training process: what issue 26 asks the trainer to
# use, and the pair launch_files.py set before it (pytorch/pytorch#123548: max_split_size_mb fights expandable segments).
ALLOCATOR_SETTINGS = {
    "expandable": "expandable_segments:True",
    "max-split": "max_split_size_mb:512,expandable_segments:True",
}
GIB = 2**30
MIB = 2**20


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.1f}"


def largest_difference(first: list[float], second: list[float]) -> float | None:
    if not first or len(first) != len(second):
        return None
    return max(abs(a - b) for a, b in zip(first, second, strict=True))


def compare_to_resident(runs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """For each (training, variant): its largest loss and checksum differences from the training's first
    resident run, and whether they are within the resident runs' own run-to-run difference."""
    by_key = {(run["training"], run["variant"]): run for run in runs}
    verdicts = {}
    for (training, variant), run in by_key.items():
        resident, again = by_key.get((training, "resident")), by_key.get((training, "resident-again"))
        if resident is None or again is None or run.get("error") or resident.get("error") or again.get("error"):
            verdicts[(training, variant)] = {"verdict": "error" if run.get("error") else "no resident pair"}
            continue
        tolerance = largest_difference(resident["losses"], again["losses"])
        checksum_tolerance = abs(resident["weights_checksum"] - again["weights_checksum"])
        loss_difference = largest_difference(resident["losses"], run["losses"])
        checksum_difference = abs(resident["weights_checksum"] - run["weights_checksum"])
        equal = (
            loss_difference is not None and tolerance is not None
            and loss_difference <= tolerance and checksum_difference <= checksum_tolerance
        )
        verdicts[(training, variant)] = {
            "loss_difference": loss_difference, "loss_tolerance": tolerance,
            "checksum_difference": checksum_difference, "checksum_tolerance": checksum_tolerance,
            "verdict": "equal" if equal else "DIFFERS",
        }
    return verdicts


def extra_blocks(runs: list[dict[str, Any]], training: str) -> str:
    """How many blocks more the lagging swapped run held at its peak than the swapped run."""
    by_variant = {run["variant"]: run for run in runs if run["training"] == training}
    swapped, lagging = by_variant.get("swapped"), by_variant.get("swapped-lagging")
    if not swapped or not lagging or not swapped.get("largest_block_bytes") or lagging.get("peak_allocated_bytes") is None:
        return "-"
    extra = (lagging["peak_allocated_bytes"] - swapped["peak_allocated_bytes"]) / swapped["largest_block_bytes"]
    return f"{extra:+.1f}"


def header(report: dict[str, Any]) -> list[str]:
    environment = report["environment"]
    versions = ", ".join(
        f"{name} {environment.get(name)}" for name in ("torch", "cuda", "driver", "pcie", "deepspeed", "diffusers", "peft") if environment.get(name)
    )
    return [
        f"### GPU probe (bench/gpu_probe.py), size {report['size']}, on {environment.get('gpu')}",
        "",
        f"{versions}; {report['seconds'].get('total')} s in all ({', '.join(f'{k} {v} s' for k, v in report['seconds'].items() if k != 'total')}).",
        "",
    ]


def pinned_lines(report: dict[str, Any]) -> list[str]:
    lines = ["| pinned tensor | shape | stored MiB | pinned MiB (torch) | ratio |", "|---|---|---|---|---|"]
    rows = report.get("pinned_per_tensor")
    if isinstance(rows, dict):
        return [f"pinned per tensor: {rows.get('error')}", ""]
    for row in rows or []:
        ratio = "-" if row["pinned_bytes"] is None else f"{row['pinned_bytes'] / row['stored_bytes']:.2f}"
        lines.append(f"| {row['tensor']} | {'x'.join(map(str, row['shape']))} | {mib(row['stored_bytes'])} | {mib(row['pinned_bytes'])} | {ratio} |")
    host = report.get("swapper_host") or {}
    if "error" in host:
        return [*lines, "", f"swapper host memory: {host['error']}", ""]
    lines += [
        "",
        f"BlockSwapper: blocks stored {gib(host.get('stored_bytes'))} GiB, pinned (host allocator) {gib(host.get('pinned_bytes'))} GiB; "
        f"RSS built {gib(host.get('rss_model_built'))}, swapper {gib(host.get('rss_swapper'))}, freed {gib(host.get('rss_freed'))}, "
        f"host cache released ({host.get('host_cache_released')}) {gib(host.get('rss_released'))} GiB.",
        "",
    ]
    return lines


def transfer_lines(report: dict[str, Any]) -> list[str]:
    speed = report.get("bandwidth") or {}
    if "h2d_pinned" not in speed:
        transfer = f"Bandwidth: {speed.get('skipped') or speed.get('error')}."
    else:
        transfer = (f"Bandwidth ({mib(speed['bytes'])} MiB): H2D pinned {speed['h2d_pinned']} GB/s, D2H pinned {speed['d2h_pinned']} GB/s, "
                    f"H2D pageable {speed['h2d_pageable']} GB/s.")
    lines = [transfer, "", "| quantised layer | base | GPU = CPU dequantised | max diff | codes differing | ms/layer device | ms/layer CPU |",
             "|---|---|---|---|---|---|---|"]
    rows = report.get("quantised")
    if isinstance(rows, dict):
        return [*lines, f"quantised: {rows.get('error')}", ""]
    for row in rows or []:
        lines.append(
            f"| {'x'.join(map(str, row['shape']))} | {row['precision']} | {row['dequantised_equal']} | {row['max_abs_difference']:.3g} | "
            f"{row['codes_differing']}/{row['codes_total']} | {row['ms_device']} | {row['ms_cpu']} |"
        )
    return [*lines, ""]


def training_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "| allocator | training | variant | vs resident | loss diff (tolerance) | alloc peak GiB | reserved peak GiB | "
        "plan GiB (no context) | retries | most resident | extra blocks lagging | s/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, record in (report.get("training") or {}).items():
        if not isinstance(record, dict) or "runs" not in record:
            lines.append(f"| {label} | {record} |")
            continue
        verdicts = compare_to_resident(record["runs"])
        for run in record["runs"]:
            verdict = verdicts[(run["training"], run["variant"])]
            charge = run.get("predicted_training_gpu_bytes")
            plan = None if charge is None else charge - (run.get("predicted_cuda_context_bytes") or 0)
            difference, tolerance = verdict.get("loss_difference"), verdict.get("loss_tolerance")
            compared = "-" if difference is None or tolerance is None else f"{difference:.3g} ({tolerance:.3g})"
            lines.append(
                f"| {label} (exit {record.get('exit')}) | {run['training']} | {run['variant']} | "
                f"{run['error'][:80] if run.get('error') else verdict['verdict']} | "
                f"{compared} | "
                f"{gib(run.get('peak_allocated_bytes'))} | {gib(run.get('peak_reserved_bytes'))} | {gib(plan)} | "
                f"{'-' if run.get('alloc_retries') is None else run['alloc_retries']} | {run.get('most_resident_blocks') or '-'} | "
                f"{extra_blocks(record['runs'], run['training']) if run['variant'] == 'swapped-lagging' else '-'} | {run['seconds_per_step']:.3f} |"
            )
    return lines


def render_table(report: dict[str, Any]) -> str:
    """The markdown the probe prints last and writes to table.md."""
    return "\n".join([*header(report), *pinned_lines(report), *transfer_lines(report), *training_lines(report)]) + "\n"
