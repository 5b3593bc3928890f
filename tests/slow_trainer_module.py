"""The real trainer (`fluxbooth.train`) on a machine slower than the plan said: every optimizer step first waits
SLOW_STEP_SECONDS. It stands in for the one fault a real part cannot produce on demand, a run that falls behind its
plan, so a test can make a job's deadline arrive in the middle of training.

Select it with `FLUXBOOTH_TRAINER_MODULE=tests.slow_trainer_module` (and PYTHONPATH at the repo root); the worker
launches it with the real `accelerate launch` like the real trainer.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

SLOW_STEP_SECONDS = 1.5


def slowed_main() -> int:
    from fluxbooth.train import loop
    from fluxbooth.train.main import main

    optimizer_step = loop._optimizer_step

    def slow_optimizer_step(*args: Any, **kwargs: Any) -> float:
        time.sleep(SLOW_STEP_SECONDS)
        return optimizer_step(*args, **kwargs)

    loop._optimizer_step = slow_optimizer_step
    return main()


if __name__ == "__main__":
    status = slowed_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
