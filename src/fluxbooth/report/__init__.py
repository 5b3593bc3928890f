"""The training report, made in the worker after training and uploaded with the weights (stage `report`).

    report/history.json       every step's loss and learning rate, the checkpoint and validation steps
    report/loss.png           loss per step, smoothed, the learning rate on a second axis, checkpoint and
                              validation marks (matplotlib, Agg canvas)
    report/likeness.png       likeness, prompt fidelity change and variety per validation step, the chosen
                              step marked (only when the likeness section says "scored")
    report/samples.png        the validation renders: a row per round and the final one, a column per prompt,
                              the chosen step's row framed (only with validation prompts)
    report/dataset.png        the training images as trained, with captions and the dataset check's flags
    report/captions.json      every training image's caption as trained and its source (`user`, `captioner`,
                              `instance_prompt`)
    report/tensorboard/       the same run as TensorBoard event files

Each part is made on its own: a part that fails is left out and named in a warning, and the job goes on
(the report never costs a user the weights). Torch-free, like everything the worker imports.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fluxbooth.contract.captioning import CAPTION_SOURCES, CAPTION_SUFFIX, CAPTIONS_REPORT_NAME
from fluxbooth.contract.captions import with_trigger
from fluxbooth.contract.events import TrainerEvent
from fluxbooth.report.history import TrainingHistory, history_from
from fluxbooth.report.likeness import chosen_step, draw_likeness, is_scored
from fluxbooth.report.loss import draw_loss
from fluxbooth.report.sheets import SheetImage, TrainingShape, draw_dataset, draw_samples
from fluxbooth.report.tensorboard import write_events
from fluxbooth.storage.artifacts import LocalArtifact, sha256_file

if TYPE_CHECKING:
    from fluxbooth.dataset import PreparedDataset

REPORT_FOLDER = "report"
REPORT_KIND = "report"

__all__ = ["REPORT_FOLDER", "Report", "ReportInputs", "SheetImage", "make_report", "report_artifacts", "sheet_images"]


@dataclass(frozen=True)
class ReportInputs:
    title: str  # the model name
    events: Sequence[TrainerEvent]
    output_dir: Path  # the trainer's output folder: validation/ is read there, report/ is written there
    dataset: Sequence[SheetImage]
    training_shape: TrainingShape
    likeness: Mapping[str, Any] | None = None  # the result's likeness section (fluxbooth.contract.scoring), if scored


@dataclass(frozen=True)
class Report:
    files: tuple[Path, ...]
    warnings: tuple[str, ...]


def sheet_images(
    dataset: PreparedDataset,
    default_prompt: str,
    flags: Mapping[str, Sequence[str]],
    captioned: frozenset[str] = frozenset(),
) -> list[SheetImage]:
    """The prepared instance images in upload order, each with the caption it trains with (its `.txt`
    file, else the instance prompt, with the trigger word as the trainer puts it), where that caption came from
    (`captioned`: the prepared images whose `.txt` the captioner wrote) and the dataset check's flags."""
    images = []
    for prepared, uploaded in dataset.uploaded_names.items():
        path = dataset.instance_dir / prepared
        caption_file = path.with_suffix(CAPTION_SUFFIX)
        # The dataset stage wrote it as UTF-8; a sheet is never worth failing the job over a caption.
        caption = caption_file.read_text(encoding="utf-8", errors="replace").strip() if caption_file.is_file() else ""
        trained = with_trigger(caption or default_prompt, dataset.trigger_word)
        source = ("captioner" if prepared in captioned else "user") if caption else "instance_prompt"
        images.append(SheetImage(uploaded, path, trained, tuple(flags.get(uploaded, ())), source))
    return images


def captions_record(images: Sequence[SheetImage]) -> dict[str, Any]:
    """report/captions.json: every training image with its caption as trained and where that came from."""
    return {
        "images": [{"image": image.name, "caption": image.caption, "source": image.source} for image in images],
        "sources": {source: sum(image.source == source for image in images) for source in CAPTION_SOURCES},
    }


def _parts(inputs: ReportInputs, history: TrainingHistory) -> list[tuple[str, Callable[[Path], object]]]:
    parts: list[tuple[str, Callable[[Path], object]]] = [
        (
            "history.json",
            lambda path: path.write_text(json.dumps(history.to_json(), indent=1) + "\n", encoding="utf-8"),
        ),
        ("loss.png", lambda path: draw_loss(history, path, f"{inputs.title}: training loss")),
    ]
    section = inputs.likeness
    if section is not None and is_scored(section):
        parts.append(("likeness.png", lambda path: draw_likeness(section, path, inputs.title)))
    if history.validation:
        chosen = chosen_step(section) if section is not None else None
        parts.append(
            ("samples.png", lambda path: draw_samples(history, path, f"{inputs.title}: validation renders", chosen))
        )
    parts.append(
        (
            "dataset.png",
            lambda path: draw_dataset(
                inputs.dataset, inputs.training_shape, path, f"{inputs.title}: dataset as trained"
            ),
        )
    )
    parts.append(
        (
            CAPTIONS_REPORT_NAME,
            lambda path: path.write_text(
                json.dumps(captions_record(inputs.dataset), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
            ),
        )
    )
    parts.append(("tensorboard", lambda path: write_events(history, path)))
    return parts


def make_report(inputs: ReportInputs) -> Report:
    """Every part that can be made, under `output_dir/report/`; a warning for each that cannot."""
    folder = inputs.output_dir / REPORT_FOLDER
    warnings: list[str] = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        history = history_from(inputs.events, inputs.output_dir)
        parts = _parts(inputs, history)
    except Exception as error:  # a report is never worth the weights: every failure becomes a warning
        return Report((), (f"report: not made ({type(error).__name__}: {error}); the weights are unaffected",))
    for name, make in parts:
        target = folder / name
        try:
            make(target)
        except Exception as error:  # see above
            warnings.append(f"report: {REPORT_FOLDER}/{name} was not made ({type(error).__name__}: {error})")
            _remove(target)
    files = tuple(sorted(path for path in folder.rglob("*") if path.is_file()))
    return Report(files, tuple(warnings))


def _remove(path: Path) -> None:
    """What a failed part left behind."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def report_artifacts(report: Report, output_dir: Path) -> list[LocalArtifact]:
    """The report's files as artifacts, named by their place under the output folder (`report/loss.png`)."""
    return [
        LocalArtifact(
            name=path.relative_to(output_dir).as_posix(),
            path=path,
            bytes=path.stat().st_size,
            sha256=sha256_file(path),
            kind=REPORT_KIND,
        )
        for path in report.files
    ]
