"""Captioning one job's photos: the captioner found (fluxbooth.captions.source), loaded (fluxbooth.captions.model),
the photos captioned batch by batch within the deadline, each caption finished by code (fluxbooth.captions.text).
Runs in the captioning process (`python -m fluxbooth.captions`); torch is imported only once a model folder is
found, so a job whose captioner is nowhere, or whose deadline has passed, learns it in a moment.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from PIL import Image

from fluxbooth.captions.prompt import caption_prompt
from fluxbooth.captions.source import CaptionerUnavailable, model_folder
from fluxbooth.captions.text import finish_caption
from fluxbooth.contract.captioning import CaptioningInput, unavailable_output
from fluxbooth.dataset.images import read_image

DEADLINE_REASON = "the job deadline left no time to caption the rest"


def read_photo(photos_dir: Path, name: str, max_side: int) -> Image.Image:
    """One photo, 8-bit RGB, at most `max_side` on its longer side (the dataset stage's reader)."""

    def unreadable(message: str) -> Exception:
        return CaptionerUnavailable(f"the captioner could not read a photo: {message}")

    return read_image(photos_dir / name, name=name, max_side=max_side, error=unreadable)


def seconds_left(request: CaptioningInput) -> float | None:
    return None if request.stop_at_unix_seconds is None else request.stop_at_unix_seconds - time.time()


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def caption_batches(
    request: CaptioningInput,
    describe: Callable[[list[Image.Image]], list[str]],
    finished: dict[str, str],
    log: Callable[[str], None],
) -> bool:
    """Caption `request.images` batch by batch into `finished`, `describe` giving each batch's raw texts; False
    when the deadline stopped it first (before a batch, less time left than the last batch took)."""
    photos_dir = Path(request.photos_dir)
    size = max(request.batch_size, 1)
    started = time.monotonic()
    last_batch = 0.0
    for first in range(0, len(request.images), size):
        left = seconds_left(request)
        if left is not None and left <= last_batch:
            log(f"stopped at {len(finished)}/{len(request.images)} photos: {DEADLINE_REASON}")
            return False
        batch_started = time.monotonic()
        names = request.images[first : first + size]
        images = [read_photo(photos_dir, name, request.max_side) for name in names]
        for name, raw in zip(names, describe(images), strict=True):
            finished[name] = finish_caption(
                raw, trigger_word=request.trigger_word, class_noun=request.class_noun, subject_type=request.subject_type
            )
        last_batch = time.monotonic() - batch_started
        log(f"captioned {len(finished)}/{len(request.images)} photos in {time.monotonic() - started:.1f} s")
    return True


def caption_photos(
    request: CaptioningInput, finished: dict[str, str], log: Callable[[str], None] = log_to_stderr
) -> dict[str, Any]:
    """The captioning output for `request` (fluxbooth.contract.captioning): `captioned`, or `unavailable` with the
    reason and the captions finished before it stopped. `finished` fills as captions are made, so a caller still
    has them when this raises."""
    started = time.monotonic()
    left = seconds_left(request)
    if left is not None and left <= 0:
        return unavailable_output(DEADLINE_REASON, finished)
    # Where models are (Hugging Face's caches, the worker's folders): the environment the worker gave this process.
    environ: Mapping[str, str] = os.environ
    try:
        source = model_folder(request, environ)
        # Deferred until a model folder is found: it imports torch and transformers, which take seconds.
        from fluxbooth.captions.model import describe, load_captioner, pick_device

        device = pick_device(request.device)
        captioner = load_captioner(request.model, source.folder, device)
        log(f"loaded the captioner {request.model} on {device} in {time.monotonic() - started:.1f} s")
        prompt = caption_prompt(request.subject_type)

        def describe_batch(images: list[Image.Image]) -> list[str]:
            return describe(captioner, images, prompt, request.max_new_tokens)

        if not caption_batches(request, describe_batch, finished, log):
            return unavailable_output(DEADLINE_REASON, finished)
    except CaptionerUnavailable as error:
        return unavailable_output(str(error), finished)
    return {
        "status": "captioned",
        "model": {"name": request.model, "revision": source.revision},
        "device": device,
        "captions": dict(finished),
        "seconds": round(time.monotonic() - started, 3),
    }
