"""The request settings the fused Adafactor full fine-tune (kohya's `--fused_backward_pass`) cannot run with."""

from __future__ import annotations

from dataclasses import dataclass

from fluxbooth.contract.names import normalise_optimizer_name


@dataclass(frozen=True)
class FusedPassConflict:
    """A setting the fused Adafactor full fine-tune (kohya's `--fused_backward_pass`) cannot run with."""

    fields: tuple[str, ...]
    # What to set instead, as a refusal's "The same job fits with ..." names it.
    change: str
    why: str


def fused_pass_conflicts(
    *,
    gradient_accumulation_steps: int,
    optimizer: str,
    optimizer_named: bool,
    mixed_precision: str,
    zero_stage: int | str,
    offload: str,
) -> list[FusedPassConflict]:
    """The request settings that rule the fused pass out (none: it may run). The one list the request's
    validation (`fused_backward_pass: true`) and the planner (which strategies honour a request) read."""
    conflicts = []
    if gradient_accumulation_steps != 1:
        conflicts.append(
            FusedPassConflict(
                ("gradient_accumulation_steps",),
                "gradient_accumulation_steps 1",
                "each weight is stepped as its gradient appears: no gradient buffer to accumulate in",
            )
        )
    if optimizer_named and normalise_optimizer_name(optimizer) != "adafactor":
        conflicts.append(
            FusedPassConflict(("optimizer",), "optimizer 'adafactor' (or none)", "the fused pass steps with Adafactor")
        )
    if mixed_precision != "bf16":
        conflicts.append(
            FusedPassConflict(("mixed_precision",), "mixed_precision 'bf16'", "the fused pass trains bf16 weights")
        )
    if zero_stage != "auto" or offload not in ("auto", "none"):
        conflicts.append(
            FusedPassConflict(
                ("zero_stage", "offload"),
                "zero_stage and offload 'auto'",
                "the fused pass runs without DeepSpeed's ZeRO",
            )
        )
    return conflicts
