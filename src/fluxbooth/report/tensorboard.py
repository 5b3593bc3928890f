"""report/tensorboard/: the run as TensorBoard event files (`tensorboard --logdir report/tensorboard`): the loss
and learning rate of every step, and each validation render at its step.

Written with the `tensorboard` package's own event writer, which imports neither TensorFlow nor torch
(tensorboardX imports torch whenever it is installed, as it is in the worker's image)."""

from __future__ import annotations

import time
from pathlib import Path

from PIL import Image

from fluxbooth.report.history import TrainingHistory

EVENT_FILE_PREFIX = "events.out.tfevents"
LOSS_TAG = "train/loss"
LR_TAG = "train/learning_rate"
VALIDATION_TAG = "validation/prompt_{index:02d}"
FINAL_TAG = "validation_final/prompt_{index:02d}"


def write_events(history: TrainingHistory, folder: Path) -> Path:
    """The event file, alone in `folder` (a new folder), renamed without the host name and process id that
    TensorBoard's writer puts in its name."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True)
    writer = EventFileWriter(str(folder))
    wall_time = time.time()
    try:
        for record in history.steps:
            values = [Summary.Value(tag=LOSS_TAG, simple_value=record.loss), Summary.Value(tag=LR_TAG, simple_value=record.lr)]
            writer.add_event(Event(wall_time=wall_time, step=record.step, summary=Summary(value=values)))
        for image in history.validation:
            with Image.open(image.path) as opened:
                width, height = opened.size
            value = Summary.Value(
                tag=(FINAL_TAG if image.final else VALIDATION_TAG).format(index=image.prompt_index),
                metadata=SummaryMetadata(display_name=image.prompt),
                image=Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=image.path.read_bytes()),
            )
            writer.add_event(Event(wall_time=wall_time, step=image.training_step, summary=Summary(value=[value])))
    finally:
        writer.close()
    (written,) = folder.glob(f"{EVENT_FILE_PREFIX}*")
    return written.rename(folder / f"{EVENT_FILE_PREFIX}.{int(wall_time)}.fluxbooth")
