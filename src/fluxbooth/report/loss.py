"""report/loss.png: the loss of every step, its smoothed line, the learning rate on a second axis, and
marks where checkpoints were saved and validation ran. matplotlib's Agg canvas, no pyplot (no global state,
no GUI backend)."""

from __future__ import annotations

from pathlib import Path

from fluxbooth.report.history import TrainingHistory, smoothed

FIGURE_INCHES = (9.0, 4.5)
DPI = 110
LOSS_COLOR = "#1f77b4"
LR_COLOR = "#d62728"
CHECKPOINT_COLOR = "#7f7f7f"
VALIDATION_COLOR = "#2ca02c"


def draw_loss(history: TrainingHistory, path: Path, title: str) -> None:
    # deferred: matplotlib is heavy to import, and the worker draws only after training
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    if not history.steps:
        raise ValueError("the trainer reported no optimizer step")
    steps = [record.step for record in history.steps]
    losses = [record.loss for record in history.steps]
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    loss_axis = figure.add_subplot()
    loss_axis.plot(
        steps,
        losses,
        color=LOSS_COLOR,
        alpha=0.3,
        linewidth=0.8,
        marker="." if len(steps) <= 50 else None,
        label="loss",
    )
    loss_axis.plot(steps, smoothed(losses), color=LOSS_COLOR, linewidth=2.0, label="loss, smoothed")
    loss_axis.set_xlabel("optimizer step")
    loss_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_axis.set_ylabel("loss", color=LOSS_COLOR)
    loss_axis.grid(alpha=0.3)
    for index, step in enumerate(history.checkpoints):
        loss_axis.axvline(
            step, color=CHECKPOINT_COLOR, linestyle="--", linewidth=1, label="checkpoint saved" if index == 0 else None
        )
    for index, step in enumerate(history.validation_steps):
        loss_axis.axvline(
            step,
            color=VALIDATION_COLOR,
            linestyle=":",
            linewidth=1.5,
            label="validation rendered" if index == 0 else None,
        )
    rate_axis = loss_axis.twinx()
    rate_axis.step(
        steps,
        [record.lr for record in history.steps],
        where="post",
        color=LR_COLOR,
        linewidth=1.2,
        label="learning rate",
    )
    rate_axis.set_ylabel("learning rate", color=LR_COLOR)
    rate_axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    rate_axis.set_ylim(bottom=0)
    handles, labels = loss_axis.get_legend_handles_labels()
    rate_handles, rate_labels = rate_axis.get_legend_handles_labels()
    figure.legend(handles + rate_handles, labels + rate_labels, loc="outside lower center", ncols=5, fontsize="small")
    loss_axis.set_title(title)
    figure.savefig(path, format="png")
