"""Progress events, stage timing and resource peaks, printed by the main process only."""

from __future__ import annotations

import gc
import resource
import sys
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fluxbooth.contract.events import (
    CheckpointEvent,
    DoneEvent,
    ErrorEvent,
    StageEvent,
    StepEvent,
    TrainerEvent,
    WarningEvent,
    format_event,
)


class EventReporter:
    """Prints `fluxbooth.contract.events` lines on stdout (flushed) when `enabled` (the main process)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def emit(self, event: TrainerEvent) -> None:
        if self.enabled:
            print(format_event(event), file=sys.stdout, flush=True)

    def stage(self, name: str, **details: Any) -> None:
        self.emit(StageEvent(stage=name, details=details))

    def step(self, step: int, total: int, loss: float, lr: float, seconds_per_step: float) -> None:
        self.emit(StepEvent(step=step, total=total, loss=loss, lr=lr, seconds_per_step=round(seconds_per_step, 6)))

    def warning(self, message: str) -> None:
        self.emit(WarningEvent(message=message))

    def error(self, code: str, message: str, **details: Any) -> None:
        self.emit(ErrorEvent(code=code, message=message, details=details))

    def checkpoint(self, step: int, path: str) -> None:
        self.emit(CheckpointEvent(step=step, path=path))

    def done(self, metrics: dict[str, Any], artifacts: list[dict[str, Any]]) -> None:
        self.emit(DoneEvent(metrics=metrics, artifacts=artifacts))


class StageClock:
    """Seconds spent per stage; stages may repeat (e.g. validate), their times add up."""

    def __init__(self, reporter: EventReporter) -> None:
        self.reporter = reporter
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str, **fields: Any) -> Iterator[None]:
        self.reporter.stage(name, **fields)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + time.perf_counter() - started, 3)


def peak_host_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_gpu_metrics() -> dict[str, int]:
    """PyTorch's allocator peaks on this process's GPU: what tensors held, and what the caching allocator
    reserved (NVML sees the reserved bytes plus the CUDA context). Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    return {
        "peak_gpu_bytes": int(torch.cuda.max_memory_allocated()),
        "peak_gpu_reserved_bytes": int(torch.cuda.max_memory_reserved()),
    }


def free_accelerator_memory() -> None:
    """Return what the freed tensors held: the CUDA caching allocator's unused blocks, and the pinned host
    blocks PyTorch's caching host allocator keeps after they are freed (DeepSpeed's CPU-offload buffers once
    the engine is gone), which it otherwise keeps page-locked until the process exits."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        release_pinned_host_cache()


def release_pinned_host_cache() -> bool:
    """Unpin and free every pinned host block no tensor uses: `torch.accelerator.empty_host_cache` (public in
    this image's torch), or `torch._C._host_emptyCache` in CUDA builds of torch before it (2.5 on). False
    where this torch has neither; call it only with an accelerator (a CPU-only torch raises)."""
    public = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty_host_cache = public or getattr(torch._C, "_host_emptyCache", None)
    if empty_host_cache is None:
        return False
    empty_host_cache()
    return True


class ReleaseTracker:
    """Weak references to the encoders and VAE, to prove they are gone before the transformer loads."""

    def __init__(self) -> None:
        self._references: list[tuple[str, weakref.ref[Any]]] = []

    def track(self, name: str, module: Any) -> None:
        self._references.append((name, weakref.ref(module)))

    def alive(self) -> list[str]:
        gc.collect()
        return [name for name, reference in self._references if reference() is not None]

    @property
    def tracked(self) -> list[str]:
        return [name for name, _ in self._references]
