"""What the worker and the captioning process agree on: the request the job writes, the captions it reads back.

Standard library only: the worker (which never imports torch) writes a `CaptioningInput` and reads the
`CaptioningOutput`; the captioning process (`python -m fluxbooth.captions --input captioning-input.json --output
captions-output.json`) loads the captioner, captions each listed photo and writes the finished captions: each one
`"{trigger} {class noun}, {description}"`, the model's preambles, subject phrase and (for persons) identity words
taken out by code (fluxbooth.captions.text). The worker still checks the trigger word is in every caption it
trains on, and falls back to the instance prompt for any photo without one.

The output, status "captioned":
    {"status": "captioned", "model": {"name", "revision"}, "device": "cuda"|"cpu",
     "captions": {"<image file name>": "<finished caption>"}, "seconds": float}
status "unavailable": unavailable_output(reason); `captions` then holds what was finished before it stopped.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

CaptioningMode = Literal["off", "missing"]
# Where each trained caption came from (report/captions.json's `source`).
CAPTION_SOURCES: tuple[str, ...] = ("user", "captioner", "instance_prompt")

# The default captioner: Apache-2.0, native in transformers (Qwen3VLForConditionalGeneration, no remote code),
# promptable, 4,264,218,424 bytes of bf16 safetensors at this revision.
DEFAULT_CAPTION_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
DEFAULT_CAPTION_REVISION = "89644892e4d85e24eaac8bacfd4f463576704203"
DEFAULT_CAPTION_MODEL_BYTES = 4_264_218_424
# The captioner the worker builds itself from configs (random weights, no download), for tests and the demo.
TINY_CAPTIONER = "fluxbooth/tiny-captioner"
# The tiny captioner's weights, rounded up (the planner prices a captioner by its weights' bytes).
TINY_CAPTIONER_BYTES = 10**6
# Images per generate() call, the longest side an image is shrunk to, and the most tokens a caption may take.
CAPTION_BATCH_SIZE = 8
CAPTION_MAX_SIDE = 512
CAPTION_MAX_NEW_TOKENS = 96

# The endpoint's captioner: a Hugging Face repo id (`org/name`, or `org/name@revision`), a local folder, or
# TINY_CAPTIONER. The default model is read at DEFAULT_CAPTION_REVISION; another repo id at its `@revision`, else
# at its newest commit.
CAPTION_MODEL_VARIABLE = "FLUXBOOTH_CAPTION_MODEL"

# The captioning process's module (`python -m`), and the caption file beside each photo (`<stem>.txt`).
CAPTIONING_MODULE = "fluxbooth.captions"
CAPTION_SUFFIX = ".txt"

CAPTIONING_INPUT_NAME = "captioning-input.json"
CAPTIONING_OUTPUT_NAME = "captions-output.json"
# The report's list of every training image with its caption as trained (report/captions.json).
CAPTIONS_REPORT_NAME = "captions.json"


@dataclass(frozen=True)
class CaptioningInput:
    """One job's (or one `caption` command's) captioning request."""

    photos_dir: str  # the normalised training photos (the instance folder)
    images: tuple[str, ...]  # the file names in photos_dir to caption, in this order
    model: str  # a Hugging Face repo id, a local folder, or TINY_CAPTIONER
    revision: str | None  # None for a local folder or the tiny captioner
    trigger_word: str | None  # put first in every caption; None: the class noun leads
    class_noun: str  # "person", "dog", ...: follows the trigger word
    subject_type: str  # "person" | "pet" | "object" | "auto": persons lose identity words
    seed: int = 0  # for the tiny captioner's weights; decoding is greedy
    stop_at_unix_seconds: float | None = None  # write what is finished and exit by then
    device: str = "auto"  # "auto" (CUDA when there is one), "cuda" or "cpu"
    batch_size: int = CAPTION_BATCH_SIZE
    max_new_tokens: int = CAPTION_MAX_NEW_TOKENS
    max_side: int = CAPTION_MAX_SIDE

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, path: Path) -> CaptioningInput:
        values = json.loads(path.read_text())
        values["images"] = tuple(values["images"])
        return cls(**values)


def captioning_command(input_path: Path, output_path: Path) -> list[str]:
    """The captioning process's command line, in this interpreter."""
    return [sys.executable, "-m", CAPTIONING_MODULE, "--input", str(input_path), "--output", str(output_path)]


def caption_model(reference: str) -> tuple[str, str | None]:
    """The model and revision a FLUXBOOTH_CAPTION_MODEL value names (the setting's comment above)."""
    reference = reference.strip()
    if reference.startswith(("/", ".", "~")):  # a local folder: an `@` in its path is part of the path
        return reference, None
    name, _, revision = reference.partition("@")
    if revision:
        return name, revision
    return name, DEFAULT_CAPTION_REVISION if name == DEFAULT_CAPTION_MODEL else None


def captioner_bytes(model: str) -> int:
    """The bytes of weights the planner prices captioning by: the tiny captioner's, else the default model's
    (another repo or folder is priced as a model of the default's size)."""
    return TINY_CAPTIONER_BYTES if caption_model(model)[0] == TINY_CAPTIONER else DEFAULT_CAPTION_MODEL_BYTES


def unavailable_output(reason: str, captions: dict[str, str] | None = None) -> dict[str, Any]:
    """The output when the captioner could not caption (every photo, or the rest): the job falls back to the
    instance prompt for the photos without a caption and says why in one warning."""
    return {"status": "unavailable", "reason": reason, "captions": dict(captions or {})}


def read_captioning_output(path: Path) -> dict[str, Any]:
    """The output the captioning process wrote, or an `unavailable` one saying why it cannot be read. Captions
    that are not strings, or name no listed image, are dropped by the caller (fluxbooth.job.captioning_stage)."""
    try:
        output = json.loads(path.read_text())
    except FileNotFoundError:
        return unavailable_output("the captioning process wrote no result")
    except (OSError, ValueError) as error:
        return unavailable_output(f"the captioning result could not be read: {error}")
    if (
        not isinstance(output, dict)
        or output.get("status") not in ("captioned", "unavailable")
        or not isinstance(output.get("captions"), dict)
    ):
        return unavailable_output("the captioning result is not a captions section")
    return output
