"""One clock per job: the deadline every stage before the trainer, every network read included, runs inside.

A stage asks `bound(budget, stage)` for the time it may wait (its own budget, or what is left of the job,
whichever is smaller) and `check(stage)` between steps; both end the job as `timeout`, naming the stage,
once the deadline has passed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import describe_seconds


@dataclass(frozen=True)
class JobClock:
    """The job's deadline: `deadline_seconds` after `started` (time.monotonic())."""

    started: float
    deadline_seconds: float

    @property
    def deadline_at(self) -> float:
        """The monotonic time the job must be over by."""
        return self.started + self.deadline_seconds

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once it has passed)."""
        return self.deadline_at - time.monotonic()

    def expired(self, stage: str) -> FluxboothError:
        """The job's `timeout`, naming the stage that was running when the deadline passed (`stage` reads
        after "while": "downloading dataset_url"). The worker itself is fine: no restart."""
        return FluxboothError(
            ErrorCode.TIMEOUT,
            f"the job deadline of {describe_seconds(self.deadline_seconds)} passed while {stage}; raise "
            "timeout_seconds (or FLUXBOOTH_JOB_DEADLINE_SECONDS on the endpoint), or serve the files faster",
            refresh_worker=False,
            details={"stage": stage},
        )

    def check(self, stage: str) -> None:
        """Raise the job's `timeout` when the deadline has passed."""
        if self.remaining() <= 0:
            raise self.expired(stage)

    def bound(self, budget: float, stage: str) -> float:
        """The smaller of a wait's own budget and the time left; `timeout` when none is left."""
        left = self.remaining()
        if left <= 0:
            raise self.expired(stage)
        return min(budget, left)
