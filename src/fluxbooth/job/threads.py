"""Blocking work off the event loop, so a job's loop keeps serving the runpod SDK's job-stop channel meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

Result = TypeVar("Result")


async def in_thread(function: Callable[..., Result], *args: Any) -> Result:
    """Blocking work (model build, downloads, image decoding, hashing, uploads) runs in a thread, so the
    event loop keeps serving the runpod SDK's job-stop channel. When the job is cancelled meanwhile,
    the thread is waited for before re-raising: it writes into the job directory, which goes next."""
    work = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # the cancellation is what the caller must see
            await work
        raise
