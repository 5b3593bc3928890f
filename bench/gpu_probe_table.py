"""bench/gpu_probe.py's one table, from the report it gathered (pure: no torch)."""

from __future__ import annotations

import math
from typing import Any

GIB = 2**30
MIB = 2**20
MEASURED_SECTIONS = ("resident", "swapped", "render")


def gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def ratio(measured: float | None, planned: float | None) -> str:
    if measured is None or not planned:
        return "-"
    return f"{measured / planned:.2f}"


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def limit(value: int | None) -> str:
    return "unlimited" if value is None else f"{value // 1024} KiB"


def header(report: dict[str, Any]) -> list[str]:
    """The machine, every version a number depends on, the container's limits, the import check."""
    found = report.get("imports") or {}
    imported = found.get("imports") or {}
    versions = ", ".join(
        f"{name} {imported.get(name, '-')}" for name in ("torch", "deepspeed", "diffusers", "peft", "transformers")
    )
    machine = ", ".join(
        f"{name} {found[name]}" for name in ("cuda", "driver", "pcie", "python", "cpu_count") if found.get(name)
    )
    shm = found.get("dev_shm_bytes")
    lines = [
        f"### GPU probe (bench/gpu_probe.py), size {report['size']}, on {found.get('gpu', 'unknown')}",
        "",
        f"{machine}; {versions}; allocator {report.get('allocator')}; {report.get('seconds')} s in all.",
        "",
        f"Import check: exit {found.get('exit')}, {'ok' if found.get('ok') else 'FAILED'}"
        f"{'' if found.get('ok') else ' (' + '; '.join(f'{k}: {v}' for k, v in imported.items() if v.startswith('FAILED')) + ')'}; "
        f"`ulimit -l` {limit(found.get('memlock_soft'))} (hard {limit(found.get('memlock_hard'))}); "
        f"/dev/shm {gib(shm) + ' GiB' if isinstance(shm, int) else shm}.",
        "",
    ]
    if report.get("device") == "cpu":
        lines += ["CPU dry run: the planner's figures are an H100's; the device's peaks need CUDA.", ""]
    return lines


def measured_and_planned(row: dict[str, Any], section: str) -> tuple[float | None, float | None, int | None]:
    """The measured seconds, the planner's, and the planner's GPU charge for the same phase."""
    planned = row.get("planned") or {}
    if section == "render":
        return row.get("render_seconds"), planned.get("render_seconds"), planned.get("validation_gpu_bytes")
    return row.get("seconds_per_step"), planned.get("seconds_per_step"), planned.get("training_gpu_bytes")


def losses_against_resident(losses: list[float], resident: list[float] | None) -> str:
    """The swapped run's largest loss difference from the resident run's (the same seed, data and kernels)."""
    if not resident or len(resident) != len(losses):
        return ""
    return f" (largest difference from resident {max(abs(a - b) for a, b in zip(losses, resident, strict=True)):.3g})"


def notes(row: dict[str, Any], section: str, resident_losses: list[float] | None) -> str:
    parts = []
    losses = row.get("losses")
    if losses:
        finite = all(math.isfinite(loss) for loss in losses)
        against = losses_against_resident(losses, resident_losses) if section == "swapped" else ""
        parts.append(
            f"losses {', '.join(f'{loss:.4g}' for loss in losses)}{'' if finite else ' (NOT FINITE)'}{against}"
        )
    if row.get("card_cap") is not None:
        parts.append(f"card cap {row['card_cap']:.3f} of the card")
    if row.get("most_resident_blocks") is not None:
        parts.append(f"most resident blocks {row['most_resident_blocks']}")
    if row.get("host_bytes") is not None:
        parts.append(f"blocks in host RAM {gib(row['host_bytes'])} GiB, set up in {row.get('swapper_seconds')} s")
    if row.get("retries"):
        parts.append(f"allocator retries {row['retries']}")
    if row.get("build_seconds") is not None:
        parts.append(f"built in {row['build_seconds']} s")
    if section == "render" and row.get("images") is not None:
        parts.append(f"images {', '.join(row['images']) or 'none'}")
    if row.get("error"):
        parts.append(f"ERROR {row['error'][:160]}")
    return "; ".join(parts) or "-"


def section_line(report: dict[str, Any], section: str) -> str:
    row = report.get(section) or {}
    measured, planned, charge = measured_and_planned(row, section)
    context = (row.get("planned") or {}).get("cuda_context_bytes") or 0
    plan_less_context = None if charge is None else charge - context
    card = (row.get("planned") or {}).get("card_bytes")
    return (
        f"| {section} | {row.get('exit')} ({row.get('wall_seconds', '-')} of {row.get('budget', '-')} s) | "
        f"{gib(card)} | {seconds(measured)} | {seconds(planned)} | "
        f"{ratio(measured, planned)} | {gib(row.get('peak_allocated_bytes'))} | {gib(row.get('peak_reserved_bytes'))} | "
        f"{gib(row.get('nvml_used_bytes'))} | {gib(plan_less_context)} | "
        f"{ratio(row.get('peak_reserved_bytes'), plan_less_context)} | {notes(row, section, (report.get('resident') or {}).get('losses'))} |"
    )


def render_table(report: dict[str, Any]) -> str:
    """The markdown the probe prints last and writes to table.md: seconds are per training step (the first not
    timed) or for the one render; the plan's GPU charge is the training (or validation) phase's, less its CUDA
    context, against the allocator's reserved peak."""
    lines = [
        *header(report),
        "| section | exit (s of budget) | card GiB (planned) | s measured | s planned | measured / planned | "
        "peak allocated GiB | peak reserved GiB | NVML used GiB | plan GiB (less context) | reserved / plan | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(section_line(report, section) for section in MEASURED_SECTIONS),
    ]
    return "\n".join(lines) + "\n"
