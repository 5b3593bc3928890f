"""Progress: the payloads a job sends (`ProgressReporter`: stage changes at once, counts and steps throttled), and
those payloads rendered for people on a terminal or in a log (`ProgressBar`).

The bar is used where no RunPod endpoint receives the payloads: `python -m fluxbooth train` and the handler's local
modes. Each stage (and each status a stage reports) is one line. Its progress, a bar with step/total, loss
and ETA while training, bytes while downloading, images while preparing the dataset, is one more line: on a terminal redrawn in place (`\\r`),
anywhere else (a log file, a pipe) written again at most every `plain_interval` seconds, and at the end.

Every line starts with the time since the job began, so a long silent phase shows in the log.
Torch-free, like everything the worker process imports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from fluxbooth.contract.events import StageEvent, StepEvent, TrainerEvent
from fluxbooth.messages import format_bytes

ProgressSink = Callable[[dict[str, Any]], None]
PROGRESS_MIN_INTERVAL_SECONDS = 2.0

logger = logging.getLogger(__name__)

BAR_WIDTH = 24
PLAIN_INTERVAL_SECONDS = 10.0
# Payload fields that the bar itself shows; any other field is shown as `name=value`.
STEP_FIELDS = frozenset({"stage", "step", "total", "loss", "eta_seconds"})
BYTE_FIELDS = frozenset({"stage", "bytes_done", "bytes_total"})
COUNT_FIELDS = frozenset({"stage", "done", "total"})


def format_duration(seconds: float) -> str:
    """`m:ss`, or `h:mm:ss` from an hour on: 75 → "1:15", 3725 → "1:02:05"."""
    whole = max(0, int(round(seconds)))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    """`[#########---------------]` filled in proportion to done/total."""
    fraction = min(1.0, max(0.0, done / total)) if total > 0 else 0.0
    filled = int(fraction * width)
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def _format_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(item) for item in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _details(payload: Mapping[str, Any], shown: frozenset[str]) -> str:
    return "  ".join(f"{name}={_format_value(payload[name])}" for name in sorted(payload) if name not in shown)


def describe(payload: Mapping[str, Any]) -> str:
    """The text of one payload, without the elapsed-time prefix."""
    stage = str(payload.get("stage", ""))
    if "step" in payload and "total" in payload:
        step, total = int(payload["step"]), int(payload["total"])
        parts = [stage, bar(step, total), f"{step}/{total}"]
        if isinstance(payload.get("loss"), (int, float)):
            parts.append(f"loss {payload['loss']:.4f}")
        if isinstance(payload.get("eta_seconds"), (int, float)):
            parts.append(f"ETA {format_duration(payload['eta_seconds'])}")
        shown = STEP_FIELDS
    elif "bytes_done" in payload and "bytes_total" in payload:
        done, total = int(payload["bytes_done"]), int(payload["bytes_total"])
        percent = f"{100 * done // total}%" if total > 0 else "?%"
        parts = [stage, bar(done, total), percent, f"{format_bytes(done)} / {format_bytes(total)}"]
        shown = BYTE_FIELDS
    elif "done" in payload and "total" in payload:
        done, total = int(payload["done"]), int(payload["total"])
        parts, shown = [stage, bar(done, total), f"{done}/{total}"], COUNT_FIELDS
    else:
        parts, shown = [stage], frozenset({"stage"})
    details = _details(payload, shown)
    return "  ".join(parts + ([details] if details else []))


# (done, total) field pairs of the kinds of progress a payload can carry.
PROGRESS_PAIRS = (("step", "total"), ("bytes_done", "bytes_total"), ("done", "total"))


def _progress_of(payload: Mapping[str, Any]) -> tuple[int, int] | None:
    for done, total in PROGRESS_PAIRS:
        if done in payload and total in payload:
            return int(payload[done]), int(payload[total])
    return None


def _is_progress(payload: Mapping[str, Any]) -> bool:
    return _progress_of(payload) is not None


def _is_complete(payload: Mapping[str, Any]) -> bool:
    done, total = _progress_of(payload) or (0, 1)
    return done >= total


@dataclass
class ProgressBar:
    """A progress sink (`ProgressSink`) that writes to `stream`; `interactive` redraws in place."""

    stream: TextIO
    interactive: bool
    clock: Callable[[], float] = time.monotonic
    plain_interval: float = PLAIN_INTERVAL_SECONDS
    _started: float | None = field(default=None, init=False)
    _stage: str | None = field(default=None, init=False)
    _line_width: int = field(default=0, init=False)
    _last_plain_progress: float = field(default=float("-inf"), init=False)

    @classmethod
    def for_stream(cls, stream: TextIO) -> ProgressBar:
        """Redrawn in place on a terminal, plain lines otherwise."""
        isatty = getattr(stream, "isatty", None)
        return cls(stream, interactive=bool(isatty and isatty()))

    def __call__(self, payload: Mapping[str, Any]) -> None:
        now = self.clock()
        if self._started is None:
            self._started = now
        stage = str(payload.get("stage", ""))
        new_stage = stage != self._stage
        self._stage = stage
        line = f"[{format_duration(now - self._started)}] {describe(payload)}"
        if not _is_progress(payload):
            self.close()
            self.stream.write(line + "\n")
        elif self.interactive:
            self._redraw(line, new_line=new_stage)
        elif new_stage or self._plain_progress_due(payload, now):
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the line being redrawn, so what is written next starts on its own line."""
        if self._line_width:
            self.stream.write("\n")
            self.stream.flush()
        self._line_width = 0

    def _redraw(self, line: str, *, new_line: bool) -> None:
        if new_line:
            self.close()
        # Pad over the end of a longer previous drawing.
        self.stream.write("\r" + line.ljust(self._line_width))
        self._line_width = len(line)

    def _plain_progress_due(self, payload: Mapping[str, Any], now: float) -> bool:
        if _is_complete(payload) or now - self._last_plain_progress >= self.plain_interval:
            self._last_plain_progress = now
            return True
        return False


@dataclass
class ProgressReporter:
    """Forwards stage changes at once and step updates at most every couple of seconds."""

    sink: ProgressSink | None
    min_interval: float = PROGRESS_MIN_INTERVAL_SECONDS
    _last_sent: float = field(default=0.0, init=False)
    _stage: str = field(default="", init=False)

    def stage(self, name: str, /, **extra: Any) -> None:
        self._stage = name
        self._send({"stage": name, **extra}, force=True)

    def count(self, name: str, done: int, total: int) -> None:
        """Items done of a stage (images prepared, ...): at most every couple of seconds, and the last."""
        self._send({"stage": name, "done": done, "total": total}, force=done >= total)

    def count_from_thread(self, name: str) -> Callable[[int, int], None]:
        """`count` for work running in a thread: the update is handed to the event loop, where the sink runs."""
        loop = asyncio.get_running_loop()

        def count(done: int, total: int) -> None:
            loop.call_soon_threadsafe(self.count, name, done, total)

        return count

    def trainer_event(self, event: TrainerEvent) -> None:
        if isinstance(event, StageEvent):
            self.stage(event.stage, **event.details)
        elif isinstance(event, StepEvent):
            step, total = event.step, event.total
            self._send(
                {
                    "stage": "train",
                    "step": step,
                    "total": total,
                    "loss": event.loss,
                    "eta_seconds": round(event.seconds_per_step * (total - step), 1),
                },
                force=step == total,
            )

    def _send(self, payload: dict[str, Any], *, force: bool) -> None:
        now = time.monotonic()
        if self.sink is None or (not force and now - self._last_sent < self.min_interval):
            return
        self._last_sent = now
        try:
            self.sink(payload)
        except Exception:  # progress is best effort; a failing sink must never fail the job
            logger.warning("progress update failed", exc_info=True)


def throttled(report: Callable[[dict[str, Any]], None], min_interval: float) -> Callable[[int, int], None]:
    """A progress sink for the download thread: hands `{"bytes_done", "bytes_total"}` to `report` on the
    running event loop, at most every `min_interval` seconds, and always the last one."""
    loop = asyncio.get_running_loop()
    last_sent = [float("-inf")]

    def sink(done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last_sent[0] < min_interval:
            return
        last_sent[0] = now
        loop.call_soon_threadsafe(report, {"bytes_done": done, "bytes_total": total})

    return sink
