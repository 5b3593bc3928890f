"""report/likeness.png: the likeness section's scores against step (step 0 = the base model), one panel each
for likeness (with its standard error), prompt fidelity change and variety, the chosen step marked. A step
with no scored render is a gap with a note saying why. matplotlib's Agg canvas, no pyplot (no global state,
no GUI backend)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fluxbooth.contract.scoring import BASE_STEP, PROXY_NOTE
from fluxbooth.report.loss import DPI
from fluxbooth.report.sheets import CHOSEN_INK

if TYPE_CHECKING:
    from pathlib import Path

    from matplotlib.axes import Axes

FIGURE_INCHES = (9.0, 7.0)
SCORED = "scored"
# matplotlib's default colour cycle, by place
LIKENESS_COLOR = "C0"
FIDELITY_COLOR = "C4"
VARIETY_COLOR = "C2"
REFERENCE_COLOR = "C7"
NOTE_COLOR = "#555555"
MAX_LABELLED_STEPS = 16  # beyond, the step axis gets evenly spaced ticks instead of one per scored step
NOTE_CHARS = 115  # the proxy note and the selection sentence, wrapped to the figure's width

# (key in a step record, axis label, colour, reference line) per panel, top to bottom.
PANELS: tuple[tuple[str, str, str, float | None], ...] = (
    ("likeness", "likeness\n(0 = base model, 1 = photos)", LIKENESS_COLOR, None),
    ("prompt_fidelity_change", "prompt fidelity\nchange from step 0", FIDELITY_COLOR, 0.0),
    ("variety", "variety: similarity among\nrenders (lower = varied)", VARIETY_COLOR, None),
)


def is_scored(section: Mapping[str, Any]) -> bool:
    return section.get("status") == SCORED


def chosen_step(section: Mapping[str, Any]) -> int | None:
    """The step the section selected, or None (not scored, nothing selected, or not a step number)."""
    step = section.get("selected_step")
    return step if is_scored(section) and isinstance(step, int) and not isinstance(step, bool) else None


def _value(record: Mapping[str, Any], key: str) -> float:
    """A score as a float, NaN where the section holds null (matplotlib leaves a gap there)."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def gap_note(record: Mapping[str, Any], unscored_steps: Sequence[int]) -> str:
    """Why a step's likeness is missing, in a few words."""
    if record.get("step") in unscored_steps:
        return "not scored (deadline)"
    if record.get("face_detect_rate") == 0:
        return "no face found"
    return "no render scored"


def draw_likeness(section: Mapping[str, Any], path: Path, title: str) -> None:
    """Three panels sharing the step axis; raises ValueError for a section that is not scored or holds no step."""
    # deferred: matplotlib is heavy to import, and the worker draws only after training
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not is_scored(section):
        raise ValueError(f"the likeness section is {section.get('status')!r}, not {SCORED!r}")
    records = sorted(section.get("steps") or [], key=lambda record: record["step"])
    if not records:
        raise ValueError("the likeness section holds no step")
    steps = [int(record["step"]) for record in records]
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    chosen = chosen_step(section)
    for axis, (key, label, color, reference) in zip(axes, PANELS, strict=True):
        values = [_value(record, key) for record in records]
        errors = [_value(record, "likeness_se") for record in records] if key == "likeness" else None
        _draw_panel(axis, steps, values, errors, color, label)
        if reference is not None:
            axis.axhline(reference, color=REFERENCE_COLOR, linestyle="--", linewidth=0.8)
        if chosen is not None:
            label_chosen = f"chosen: step {chosen}" if key == "likeness" else None
            axis.axvline(chosen, color=_rgb(CHOSEN_INK), linewidth=6.0, alpha=0.35, zorder=0, label=label_chosen)
    _mark_likeness_scale(axes[0])
    _note_gaps(axes[0], records, [int(step) for step in section.get("unscored_steps") or []])
    _step_axis(axes[-1], steps)
    axes[0].legend(loc="best", fontsize="small")
    proxy = "\n".join(textwrap.wrap(PROXY_NOTE, NOTE_CHARS))
    figure.suptitle(f"{title}: likeness, prompt fidelity and variety per step\n{proxy}", fontsize="medium")
    if isinstance(selection := section.get("selection"), str) and selection:
        figure.supxlabel("\n".join(textwrap.wrap(selection, NOTE_CHARS)), fontsize="small", color=NOTE_COLOR)
    figure.savefig(path, format="png")


def _draw_panel(
    axis: Axes, steps: list[int], values: list[float], errors: list[float] | None, color: str, label: str
) -> None:
    if errors is not None:
        bars = [0.0 if math.isnan(error) else error for error in errors]
        axis.errorbar(
            steps,
            values,
            yerr=bars,
            color=color,
            marker="o",
            capsize=3,
            linewidth=1.5,
            label="likeness ± 1 standard error",
        )
    else:
        axis.plot(steps, values, color=color, marker="o", linewidth=1.5)
    axis.set_ylabel(label, color=color, fontsize="small")
    axis.grid(alpha=0.3)


def _mark_likeness_scale(axis: Axes) -> None:
    """The scale's two ends: 0 is the base model's renders, 1 the training photos to each other."""
    for level in (0.0, 1.0):
        axis.axhline(level, color=REFERENCE_COLOR, linestyle="--", linewidth=0.8)


def _note_gaps(axis: Axes, records: Sequence[Mapping[str, Any]], unscored_steps: Sequence[int]) -> None:
    """A vertical note at each step whose likeness is null, so a gap reads as 'why', not as a zero."""
    transform = axis.get_xaxis_transform()  # x in steps, y in axes fraction
    for record in records:
        if math.isnan(_value(record, "likeness")):
            axis.text(
                record["step"],
                0.04,
                gap_note(record, unscored_steps),
                transform=transform,
                rotation=90,
                ha="center",
                va="bottom",
                fontsize="x-small",
                color=NOTE_COLOR,
            )


def _step_axis(axis: Axes, steps: list[int]) -> None:
    from matplotlib.ticker import MaxNLocator  # deferred with the rest of matplotlib

    pad = max(0.5, 0.04 * (steps[-1] - steps[0]))  # room for a note at the first or last step
    axis.set_xlim(steps[0] - pad, steps[-1] + pad)
    if len(steps) <= MAX_LABELLED_STEPS:
        axis.set_xticks(steps, [f"{step}\n(base)" if step == BASE_STEP else str(step) for step in steps])
    else:
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_xlabel("optimizer step")


def _rgb(color: tuple[int, int, int]) -> tuple[float, ...]:
    """A Pillow colour as matplotlib's (0..1 per channel)."""
    return tuple(channel / 255 for channel in color)
