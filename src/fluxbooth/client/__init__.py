"""A client for a fluxbooth endpoint: submit photos and a request, follow the job, fetch its files.

`python -m fluxbooth submit PHOTOS --request REQUEST.json (--endpoint ID | --url URL) --out DIR`, or from
Python: `from fluxbooth.client import Submission, submit; submit(Submission(...), os.environ)`.
Torch-free, like everything outside `train/`. The names below load on first use, so that `python -m fluxbooth`'s
other subcommands do not import requests and the zip packer.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ClientError": "fluxbooth.client.errors",
    "ExitCode": "fluxbooth.client.errors",
    "Outcome": "fluxbooth.client.submission",
    "Submission": "fluxbooth.client.submission",
    "submit": "fluxbooth.client.submission",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fluxbooth.client' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
