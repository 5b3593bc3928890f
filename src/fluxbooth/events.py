"""The line protocol between the trainer (subprocess) and the worker.

The trainer prints one JSON object per line behind a fixed marker; everything else on stdout/stderr
is ordinary log. Kept free of torch so both sides import it.
"""

from __future__ import annotations

import json
from typing import Any

EVENT_MARKER = "FLUXBOOTH_EVENT "

# Event kinds (the "event" field):
#   stage    {"stage": "load"|"cache"|"train"|"save"|"export"|"validate", ...}
#   step     {"step": int, "total": int, "loss": float, "lr": float, "seconds_per_step": float}
#   warning  {"message": str}
#   error    {"code": "nan_loss"|..., "message": str}
#   done     {"metrics": {...}, "artifacts": [{"name": str, "path": str, "kind": str}, ...]}


def format_event(event: str, **fields: Any) -> str:
    return EVENT_MARKER + json.dumps({"event": event, **fields}, sort_keys=True, allow_nan=False)


def parse_event(line: str) -> dict[str, Any] | None:
    """Return the event carried by `line`, or None when it is ordinary log output."""
    index = line.find(EVENT_MARKER)
    if index < 0:
        return None
    try:
        payload = json.loads(line[index + len(EVENT_MARKER) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("event"), str):
        return None
    return payload
