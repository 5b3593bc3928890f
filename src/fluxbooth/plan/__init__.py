"""Choosing how a job runs: ZeRO stage, offload targets, precision, training type, base precision.

- `types`: the job as the planner reads it (built from the job spec, fluxbooth.request.spec), strategies,
  estimates, candidates, the `Plan`;
- `memory`: predicted GPU, host and disk bytes per strategy and per phase (docs/memory.md);
- `gpus`, `timing`: the GPU datasheet table and the time model per step and per phase;
- `candidates`, `checks`, `refusal`, `choice`: the candidates, the checks before launch, the
  `does_not_fit` message, and `choose_plan`;
- `figures`: the planner's figures that the README and docs quote (a full fine-tune's host RAM).
No torch here.
"""

from fluxbooth.plan.candidates import (
    as_job,
    effective_precision,
    evaluate_candidates,
    honours_request,
    optimizer_for,
    pick,
    strategies_for,
)
from fluxbooth.plan.checks import check_job, deadline_check
from fluxbooth.plan.choice import choose_plan, plan_for_strategy
from fluxbooth.plan.figures import full_finetune_host_bytes
from fluxbooth.plan.memory import (
    activation_bytes,
    compute_dtype_bytes,
    estimate_memory,
    frozen_base_bytes,
    image_tokens,
    model_state_bytes,
)
from fluxbooth.plan.timing import seconds_per_step
from fluxbooth.plan.types import (
    PHASES,
    Candidate,
    JobShape,
    MemoryEstimate,
    PhaseEstimate,
    Plan,
    Strategy,
)
from fluxbooth.sizing import model_size

__all__ = [
    "PHASES",
    "Candidate",
    "JobShape",
    "MemoryEstimate",
    "PhaseEstimate",
    "Plan",
    "Strategy",
    "activation_bytes",
    "as_job",
    "check_job",
    "choose_plan",
    "compute_dtype_bytes",
    "deadline_check",
    "effective_precision",
    "estimate_memory",
    "evaluate_candidates",
    "frozen_base_bytes",
    "full_finetune_host_bytes",
    "honours_request",
    "image_tokens",
    "model_size",
    "model_state_bytes",
    "optimizer_for",
    "pick",
    "plan_for_strategy",
    "seconds_per_step",
    "strategies_for",
]
