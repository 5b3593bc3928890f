"""report/tensorboard/: the run as TensorBoard event files (`tensorboard --logdir report/tensorboard`): the loss
and learning rate of every step, and the validation renders of the rounds the report shows, each at its step,
as JPEGs of at most TENSORBOARD_IMAGE_SIDE pixels (the full renders are artifacts of their own; 1024² PNGs
would make the file tens of MB).

Written with the `tensorboard` package's own event writer, which imports neither TensorFlow nor torch
(tensorboardX imports torch whenever it is installed, as it is in the worker's image)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from fluxbooth.report.history import TrainingHistory
from fluxbooth.report.sheets import read_render

EVENT_FILE_PREFIX = "events.out.tfevents"
LOSS_TAG = "train/loss"
LR_TAG = "train/learning_rate"
VALIDATION_TAG = "validation/prompt_{index:02d}"
FINAL_TAG = "validation_final/prompt_{index:02d}"
TENSORBOARD_IMAGE_SIDE = 512
JPEG_QUALITY = 90


def _small_jpeg(path: Path) -> tuple[int, int, bytes]:
    """(width, height, JPEG bytes) of a render, its longer side at most TENSORBOARD_IMAGE_SIDE."""
    image = read_render(path, TENSORBOARD_IMAGE_SIDE)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return image.width, image.height, buffer.getvalue()


def write_events(history: TrainingHistory, folder: Path) -> Path:
    """The event file, alone in `folder` (a new folder), renamed without the host name and process id that
    TensorBoard's writer puts in its name."""
    # deferred: TensorBoard (and its protobufs) are heavy to import, needed only to write the report
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    folder.mkdir(parents=True)
    writer = EventFileWriter(str(folder))
    wall_time = time.time()
    try:
        for record in history.steps:
            values = [
                Summary.Value(tag=LOSS_TAG, simple_value=record.loss),
                Summary.Value(tag=LR_TAG, simple_value=record.lr),
            ]
            writer.add_event(Event(wall_time=wall_time, step=record.step, summary=Summary(value=values)))
        shown = set(history.shown_rounds())
        for image in (image for image in history.validation if (image.training_step, image.final) in shown):
            width, height, encoded = _small_jpeg(image.path)
            value = Summary.Value(
                tag=(FINAL_TAG if image.final else VALIDATION_TAG).format(index=image.prompt_index),
                metadata=SummaryMetadata(display_name=image.prompt),
                image=Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=encoded),
            )
            writer.add_event(Event(wall_time=wall_time, step=image.training_step, summary=Summary(value=[value])))
    finally:
        writer.close()
    (written,) = folder.glob(f"{EVENT_FILE_PREFIX}*")
    return written.rename(folder / f"{EVENT_FILE_PREFIX}.{int(wall_time)}.fluxbooth")
