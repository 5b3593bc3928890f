"""bench/gpu.py's rows in bench/RESULTS.md: one table between the `gpu` markers, one row per (run, GPU).

A GPU is lent rarely and briefly, so each call measures a few runs; its rows are merged into the table kept
in bench/RESULTS.md: a row replaces the row with the same run name on the same GPU, every other row stays, so
rows gathered in several short windows accumulate. Each row names its GPU, the versions (driver, CUDA, torch,
DeepSpeed) and the day it was recorded. Pure text: no torch, no fluxbooth.
"""

from __future__ import annotations

import re

BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
SECTION_TITLE = "### GPU: the worker on a full-size synthetic FLUX.1-dev (bench/gpu.py)"
COLUMNS = (
    "run",
    "GPU",
    "versions",
    "recorded",
    "card",
    "base",
    "plan",
    "GPU pred GiB",
    "alloc peak",
    "reserved peak",
    "NVML used peak",
    "host pred GiB",
    "host peak (PSS)",
    "s/step pred",
    "s/step",
    "phases (s)",
    "exit",
    "notes",
)
HEADER = "| " + " | ".join(COLUMNS) + " |\n" + "|" + "---|" * len(COLUMNS)
NOTE = (
    "Rows from `bench/gpu.py`, merged by run and GPU (`python bench/gpu.py --merge FILE`): a row replaces the "
    "row of the same run on the same GPU, every other row stays. GPU pred/host pred: `python -m fluxbooth plan "
    "--json`; alloc/reserved: the trainer's torch peaks; NVML: the device's used memory sampled every 0.1 s (it "
    "includes the CUDA context, and is not capped by the emulated card); host: summed PSS of the worker's process "
    "tree; s/step: median after the first step. Runs not listed have not been measured yet (docs/gpu.md)."
)


def row_cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def row_key(line: str) -> tuple[str, str]:
    """(run name, GPU) of a table row."""
    cells = row_cells(line)
    return cells[0], cells[1] if len(cells) > 1 else ""


def table_rows(section: str) -> list[str]:
    """The data rows of the table inside a section (header and separator left out)."""
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [line for line in rows if row_cells(line)[:2] != ["run", "GPU"]]


def merged_rows(existing: list[str], new: list[str]) -> list[str]:
    """`existing` with each row of `new` in place of the row with its key, or appended."""
    position = {row_key(line): index for index, line in enumerate(existing)}
    rows = list(existing)
    for line in new:
        key = row_key(line)
        if key in position:
            rows[position[key]] = line
        else:
            position[key] = len(rows)
            rows.append(line)
    return rows


def section_text(rows: list[str], skipped: list[str] | None = None) -> str:
    lines = [BEGIN, SECTION_TITLE, "", NOTE, "", HEADER, *rows]
    if skipped:
        lines += ["", "Not run in the latest call (its time budget was spent): " + ", ".join(skipped) + "."]
    return "\n".join([*lines, END])


def merge_into(results_text: str, new_rows: list[str], skipped: list[str] | None = None) -> str:
    """RESULTS.md's text with `new_rows` merged into the gpu section (created at the end when absent)."""
    match = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), results_text, flags=re.DOTALL)
    if match is None:
        separator = "" if results_text.endswith("\n") or not results_text else "\n"
        return results_text + separator + "\n" + section_text(merged_rows([], new_rows), skipped) + "\n"
    rows = merged_rows(table_rows(match.group(0)), new_rows)
    return results_text[: match.start()] + section_text(rows, skipped) + results_text[match.end() :]
