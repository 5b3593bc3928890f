"""DeepSpeed op folders as torch leaves them once an op is built, for the op-cache tests."""

from __future__ import annotations

from pathlib import Path


def built(folder: Path, *ops: str) -> Path:
    """Ops as torch leaves them once built: <op>/<op>.so."""
    for op in ops:
        (folder / op).mkdir(parents=True)
        (folder / op / f"{op}.so").write_bytes(b"\x7fELF")
    return folder
