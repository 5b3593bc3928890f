"""The line protocol between the trainer (subprocess) and the worker: one typed event per line.

The trainer prints each event as one JSON object behind a fixed marker; everything else on
stdout/stderr is ordinary log. The JSON is flat (`{"event": "step", "step": 3, ...}`); each kind
has its own dataclass here, so both sides name fields, never strings. Kept free of torch so both
sides import it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, TypeAlias

EVENT_MARKER = "FLUXBOOTH_EVENT "
# The export stage's status once every requested file is written and verified: its `artifacts` are what the worker
# keeps and uploads should the trainer fail later (a LoRA's final renders run after it).
EXPORTED_STATUS = "exported"


@dataclass(frozen=True)
class StageEvent:
    """A stage starts, or reports a status while it runs (`details`: status, step, prompts, what, ...).
    Stages: load, cache, train, checkpoint, save, export, validate."""

    KIND: ClassVar[str] = "stage"
    stage: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step finished."""

    KIND: ClassVar[str] = "step"
    step: int
    total: int
    loss: float
    lr: float
    seconds_per_step: float


@dataclass(frozen=True)
class WarningEvent:
    KIND: ClassVar[str] = "warning"
    message: str


@dataclass(frozen=True)
class ErrorEvent:
    """The trainer stops: `code` is one of fluxbooth.contract.names.ERROR_CODES."""

    KIND: ClassVar[str] = "error"
    code: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointEvent:
    """A complete checkpoint folder exists at `path` (after `step` optimizer steps)."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str


@dataclass(frozen=True)
class DoneEvent:
    """Training finished: the metrics and the artifacts ({"name", "path", "kind"}, paths relative to the output dir)."""

    KIND: ClassVar[str] = "done"
    metrics: dict[str, Any]
    artifacts: list[dict[str, Any]]


TrainerEvent: TypeAlias = StageEvent | StepEvent | WarningEvent | ErrorEvent | CheckpointEvent | DoneEvent
EVENT_TYPES: dict[str, type[TrainerEvent]] = {
    kind.KIND: kind for kind in (StageEvent, StepEvent, WarningEvent, ErrorEvent, CheckpointEvent, DoneEvent)
}
# The kinds whose leftover JSON fields are kept in `details` rather than refused.
_OPEN_KINDS = (StageEvent, ErrorEvent)


def exported_artifacts(events: list[TrainerEvent]) -> list[dict[str, Any]] | None:
    """The artifacts of the trainer's last "exported" status, None when it reported none."""
    for event in reversed(events):
        if isinstance(event, StageEvent) and event.stage == "export" and event.details.get("status") == EXPORTED_STATUS:
            artifacts = event.details.get("artifacts")
            if not isinstance(artifacts, list):
                return None
            return [dict(artifact) for artifact in artifacts if isinstance(artifact, dict)]
    return None


def event_payload(event: TrainerEvent) -> dict[str, Any]:
    """The flat JSON object of `event`, as it travels: `{"event": kind, **fields}`."""
    payload: dict[str, Any] = {"event": event.KIND}
    for item in fields(event):
        value = getattr(event, item.name)
        if item.name == "details":
            payload.update(value)
        else:
            payload[item.name] = value
    return payload


def format_event(event: TrainerEvent) -> str:
    return EVENT_MARKER + json.dumps(event_payload(event), sort_keys=True, allow_nan=False)


def event_from_payload(payload: dict[str, Any]) -> TrainerEvent | None:
    """The typed event of a flat JSON object; None for an unknown kind or missing fields."""
    kind = EVENT_TYPES.get(str(payload.get("event")))
    if kind is None:
        return None
    names = [item.name for item in fields(kind) if item.name != "details"]
    known = {name: payload[name] for name in names if name in payload}
    required = [item.name for item in fields(kind) if item.name != "details" and item.name not in known]
    if required:
        return None
    if kind in _OPEN_KINDS:
        known["details"] = {key: value for key, value in payload.items() if key != "event" and key not in names}
    return kind(**known)


def parse_event(line: str) -> TrainerEvent | None:
    """Return the event carried by `line`, or None when it is ordinary log output."""
    index = line.find(EVENT_MARKER)
    if index < 0:
        return None
    try:
        payload = json.loads(line[index + len(EVENT_MARKER) :])
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    return event_from_payload(payload)
