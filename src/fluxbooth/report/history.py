"""What the report draws, gathered from the trainer's typed events and its validation index (pure)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from fluxbooth.contract.budgets import MAX_SHOWN_ROUNDS
from fluxbooth.contract.events import CheckpointEvent, StepEvent, TrainerEvent
from fluxbooth.contract.layout import VALIDATION_FOLDER, VALIDATION_INDEX_NAME, render_index


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    lr: float
    seconds: float


@dataclass(frozen=True)
class ValidationImage:
    path: Path
    prompt: str
    prompt_index: int
    training_step: int
    final: bool  # rendered from the exported weights after the last step


@dataclass(frozen=True)
class TrainingHistory:
    steps: tuple[StepRecord, ...]
    checkpoints: tuple[int, ...]
    validation: tuple[ValidationImage, ...]

    @property
    def validation_steps(self) -> tuple[int, ...]:
        return tuple(sorted({image.training_step for image in self.validation}))

    def shown_rounds(self, keep: int | None = None) -> list[tuple[int, bool]]:
        """(training step, final) of the validation rounds the report shows: those during training, evenly
        thinned to MAX_SHOWN_ROUNDS with the first, the last and the round at step `keep` (the chosen step)
        kept, then the final render."""
        during = sorted({image.training_step for image in self.validation if not image.final})
        final = sorted({image.training_step for image in self.validation if image.final})
        room = MAX_SHOWN_ROUNDS - len(final)
        if len(during) > room:
            picks = {round(index * (len(during) - 1) / max(1, room - 1)) for index in range(room)}
            if keep in during and during.index(keep) not in picks:
                kept = during.index(keep)
                inner = sorted(picks - {0, len(during) - 1}, key=lambda index: abs(index - kept))
                picks = (picks - set(inner[:1])) | {kept}
            during = [during[index] for index in sorted(picks)]
        return [(step, False) for step in during] + [(step, True) for step in final]

    @property
    def prompts(self) -> tuple[str, ...]:
        by_index = {image.prompt_index: image.prompt for image in self.validation}
        return tuple(by_index[index] for index in sorted(by_index))

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": [asdict(record) for record in self.steps],
            "checkpoints": list(self.checkpoints),
            "validation_steps": list(self.validation_steps),
            "validation_prompts": list(self.prompts),
        }


def read_validation(output_dir: Path) -> tuple[ValidationImage, ...]:
    """The validation renders the trainer indexed; none without validation prompts."""
    index_path = output_dir / VALIDATION_FOLDER / VALIDATION_INDEX_NAME
    if not index_path.is_file():
        return ()
    records = json.loads(index_path.read_text(encoding="utf-8"))["images"]
    first_seen: dict[str, int] = {}
    images = []
    for record in records:
        file = PurePosixPath(str(record["file"]))
        # The position in the request's list, from the file's name: a prompt given twice keeps both columns.
        # A name the trainer does not write falls back to the prompt's order of first appearance.
        named = render_index(str(file))
        prompt_index = named if named is not None else first_seen.setdefault(record["prompt"], len(first_seen))
        images.append(
            ValidationImage(
                path=index_path.parent / file,
                prompt=str(record["prompt"]),
                prompt_index=prompt_index,
                training_step=int(record["training_step"]),
                final=file.parent == PurePosixPath("."),  # renders during training live in step-NNNNNN/ folders
            )
        )
    return tuple(images)


def history_from(events: Iterable[TrainerEvent], output_dir: Path) -> TrainingHistory:
    """Every optimizer step's loss and learning rate, the checkpoint saves, and the validation renders.
    A resumed run holds the steps it trained itself."""
    steps: dict[int, StepRecord] = {}
    checkpoints: set[int] = set()
    for event in events:
        if isinstance(event, StepEvent):
            steps[event.step] = StepRecord(event.step, event.loss, event.lr, round(event.seconds_per_step, 4))
        elif isinstance(event, CheckpointEvent):
            checkpoints.add(event.step)
    return TrainingHistory(
        steps=tuple(steps[step] for step in sorted(steps)),
        checkpoints=tuple(sorted(checkpoints)),
        validation=read_validation(output_dir),
    )


def smoothed(values: list[float]) -> list[float]:
    """TensorBoard's debiased exponential moving average, its window about a tenth of the run."""
    weight = min(0.99, max(0.0, 1 - 10 / len(values))) if values else 0.0
    average, result = 0.0, []
    for count, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        result.append(average / (1 - weight**count) if weight else value)
    return result
