"""The real trainer (`fluxbooth.train`) on a machine slower than the plan said: every optimizer step counts
BEHIND_PER_STEP_SECONDS more than it took, as if each had taken that much longer. The trainer's clock runs ahead by
that much per step, so a job's stop time comes in the middle of training without a test waiting for it in real
time. It stands in for the one fault a real part cannot produce on demand: a run that falls behind its plan.

Select it with `FLUXBOOTH_TRAINER_MODULE=tests.support.slow_trainer_module` (and PYTHONPATH at the repo root); the worker
launches it with the real `accelerate launch`, and its deadline and kill stay in real time.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

BEHIND_PER_STEP_SECONDS = 20.0


class ClockBehindPlan:
    """`time` as the trainer's loop reads it, with `time()` ahead by what the slowed steps would have taken."""

    def __init__(self) -> None:
        self.ahead_seconds = 0.0

    def time(self) -> float:
        return time.time() + self.ahead_seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def slowed_main() -> int:
    from fluxbooth.train import loop
    from fluxbooth.train.main import main

    clock = ClockBehindPlan()
    optimizer_step = loop._optimizer_step

    def slow_optimizer_step(*args: Any, **kwargs: Any) -> float:
        clock.ahead_seconds += BEHIND_PER_STEP_SECONDS
        return optimizer_step(*args, **kwargs)

    loop.time = clock  # type: ignore[assignment]
    loop._optimizer_step = slow_optimizer_step
    return main()


if __name__ == "__main__":
    status = slowed_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
