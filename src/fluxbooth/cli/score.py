"""`python -m fluxbooth score --photos DIR --renders DIR [--base-renders DIR] [--subject-type person|pet|object]
[--prompt TEXT]`: how much a set of renders looks like the photos' subject, from a LoRA trained anywhere.

Prints one JSON object: `likeness` (calibrated: 0 = the base renders, or without them the zero `calibration`
names; 1 = the photos to each other; null when nothing could be scored), `face_detect_rate` (persons),
`copies`, `prompt_fidelity` (null without --prompt), and the rest of what the job's likeness section says for
one step, and `not_scored` (the files in the folders that are not an image format it reads, named). Images
are read as the dataset stage reads photos (EXIF orientation, 16-bit and palette modes, colour profiles), each
shrunk as it is read. Exits 0 when scored, 1 when the scoring model is unavailable (the JSON says why), 2 on bad
arguments or a file that cannot be read (empty, not an image, truncated, over the pixel cap), naming it.
The scoring libraries load only when this command runs: the CLI's other commands stay light.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from fluxbooth.cli.exits import EXIT_FAILED, EXIT_OK
from fluxbooth.errors import ErrorCode, FluxboothError

SUBJECT_CHOICES = ("person", "pet", "object", "auto")


def add_score_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "score", help="score renders against training photos: likeness, copies, prompt fidelity"
    )
    parser.add_argument("--photos", type=Path, required=True, help="folder of the subject's training photos")
    parser.add_argument("--renders", type=Path, required=True, help="folder of renders to score")
    parser.add_argument(
        "--base-renders",
        type=Path,
        default=None,
        help="folder of the base model's renders of the same prompts and seeds: the scale's zero",
    )
    parser.add_argument(
        "--subject-type",
        choices=SUBJECT_CHOICES,
        default="auto",
        help="person (dlib face identity), pet or object (DINOv2); auto: person when most photos hold one face",
    )
    parser.add_argument(
        "--prompt", default=None, help="the renders' prompt, subject named by its class noun (SigLIP fidelity)"
    )


def run_score_command(arguments: argparse.Namespace, environ: Mapping[str, str], out: TextIO) -> int:
    for flag, folder in (
        ("--photos", arguments.photos),
        ("--renders", arguments.renders),
        ("--base-renders", arguments.base_renders),
    ):
        if folder is not None and not folder.is_dir():
            raise FluxboothError(ErrorCode.INVALID_INPUT, f"{flag}: {folder} is not a folder; give a folder of images")
    # Deferred: numpy, PIL, dlib and (for pets, objects and fidelity) torch load only for this command.
    from fluxbooth.likeness.inputs import NothingToScore
    from fluxbooth.likeness.scoring import score_folders
    from fluxbooth.likeness.weights import ModelUnavailable

    try:
        summary = score_folders(
            arguments.photos,
            arguments.renders,
            arguments.base_renders,
            arguments.subject_type,
            arguments.prompt,
            environ,
        )
    except NothingToScore as error:
        raise FluxboothError(ErrorCode.INVALID_INPUT, str(error)) from None
    except ModelUnavailable as error:
        out.write(json.dumps({"status": "unavailable", "reason": str(error), "likeness": None}, indent=2) + "\n")
        return EXIT_FAILED
    out.write(json.dumps({"status": "scored", **summary}, indent=2) + "\n")
    return EXIT_OK
