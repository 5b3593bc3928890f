"""`python -m fluxbooth caption PHOTOS --out DIR [--trigger-word W] [--class-noun N] [--subject-type T]
[--model M]`: the captions a job with `captioning: "missing"` would train on, written before submitting.

Each photo in PHOTOS without a caption file beside it gets `DIR/<stem>.txt`, captioned as the worker captions
(the same process, `python -m fluxbooth.captions`, the same model: `--model`, else FLUXBOOTH_CAPTION_MODEL, else
the default), so the captions can be read and edited, then zipped with the photos. Photos that already have a
`.txt` are left to it. Prints one JSON object (the captions written, and why any photo has none). Exits 0 when every
photo listed was captioned, 1 when the captioner could not caption some (the JSON says why), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.contract.captioning import (
    CAPTION_MODEL_VARIABLE,
    CAPTION_SUFFIX,
    DEFAULT_CAPTION_MODEL,
    CaptioningInput,
    caption_model,
    captioning_command,
    read_captioning_output,
)
from fluxbooth.dataset.members import IMAGE_EXTENSIONS
from fluxbooth.errors import ErrorCode, FluxboothError

SUBJECT_CHOICES = ("person", "pet", "object", "auto")
# The class noun when none is given: the one a job's default prompts use for the subject type.
SUBJECT_NOUNS = {"person": "person", "pet": "pet", "object": "object", "auto": "subject"}
# A folder of photos on a CPU: minutes for the real model; a hung captioner is stopped, not waited on forever.
CAPTION_COMMAND_TIMEOUT_SECONDS = 3600


def add_caption_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "caption", help="caption a folder of photos as a job with captioning: missing would, to read and edit"
    )
    parser.add_argument("photos", type=Path, help="folder of training photos")
    parser.add_argument("--out", type=Path, required=True, help="folder to write <stem>.txt captions into")
    parser.add_argument("--trigger-word", default=None, help="put first in every caption, as the job's trigger_word")
    parser.add_argument("--class-noun", default=None, help="follows the trigger word (default: by --subject-type)")
    parser.add_argument(
        "--subject-type",
        choices=SUBJECT_CHOICES,
        default="auto",
        help="person (and auto): the captions never describe face, hair, skin, age or ethnicity",
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"the captioner (default: ${CAPTION_MODEL_VARIABLE}, else {DEFAULT_CAPTION_MODEL})",
    )


def photos_to_caption(folder: Path) -> list[str]:
    """The images directly in `folder` without a caption file beside them, by name."""
    if not folder.is_dir():
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"photos: {folder} is not a folder; give a folder of images")
    return sorted(
        path.name
        for path in folder.iterdir()
        if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.with_suffix(CAPTION_SUFFIX).exists()
    )


def write_folder_captions(captions: Mapping[str, Any], images: list[str], out: Path) -> dict[str, str]:
    """Each listed image's caption as `out/<stem>.txt`: {image: caption} of those written."""
    written = {}
    for name in images:
        caption = captions.get(name)
        if isinstance(caption, str) and caption.strip():
            (out / Path(name).with_suffix(CAPTION_SUFFIX).name).write_text(caption.strip() + "\n", encoding="utf-8")
            written[name] = caption.strip()
    return written


def run_caption_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    images = photos_to_caption(arguments.photos)
    if arguments.out.exists() and not arguments.out.is_dir():
        raise FluxboothError(ErrorCode.INVALID_INPUT, f"--out: {arguments.out} is not a folder")
    arguments.out.mkdir(parents=True, exist_ok=True)
    # Deferred: the worker's job modules load only for this command, so the CLI's other commands stay light.
    from fluxbooth.job.model_process import model_process_environment

    model, revision = caption_model(arguments.model or environ.get(CAPTION_MODEL_VARIABLE) or DEFAULT_CAPTION_MODEL)
    output: dict[str, Any] = {"status": "captioned", "captions": {}}
    if images:
        with tempfile.TemporaryDirectory(prefix="fluxbooth-caption-") as work:
            input_path, output_path = Path(work) / "input.json", Path(work) / "output.json"
            CaptioningInput(
                photos_dir=str(arguments.photos.resolve()),
                images=tuple(images),
                model=model,
                revision=revision,
                trigger_word=arguments.trigger_word,
                class_noun=arguments.class_noun or SUBJECT_NOUNS[arguments.subject_type],
                subject_type=arguments.subject_type,
            ).write(input_path)
            subprocess.run(
                captioning_command(input_path, output_path),
                env=model_process_environment(environ),
                timeout=CAPTION_COMMAND_TIMEOUT_SECONDS,
                check=False,
            )
            output = read_captioning_output(output_path)
    written = write_folder_captions(output["captions"], images, arguments.out)
    summary = {
        "status": output["status"],
        "model": model,
        "captions": written,
        "not_captioned": [name for name in images if name not in written],
        "reason": output.get("reason"),
    }
    out.write(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    return EXIT_OK if len(written) == len(images) else EXIT_FAILED
