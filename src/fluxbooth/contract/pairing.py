"""The one rule that pairs a training image with its control image (FLUX.1 Kontext): the same file stem,
compared NFC-normalised and case-folded. The worker's dataset stage checks uploads by it and the trainer pairs
the stored files by it, so a pair the worker accepts is a pair the trainer finds. Torch-free: the worker
imports it."""

from __future__ import annotations

import unicodedata
from pathlib import PurePosixPath


def normalised_stem(name: str) -> str:
    """A file name's stem (the part before its last suffix, folders dropped) in Unicode NFC, case kept."""
    return unicodedata.normalize("NFC", PurePosixPath(name).stem)


def pair_key(name: str) -> str:
    """What two files of a pair share: their stem, NFC-normalised and case-folded ("Photo0.JPG" and
    "control/photo0.png" pair; "写真1.jpg" and "control/画像1.jpg" do not)."""
    return unicodedata.normalize("NFC", normalised_stem(name).casefold())
