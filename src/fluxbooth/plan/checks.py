"""Checks that run before anything is downloaded: LoRA targets against the model's module names (read
from its configs), the base precision against the training type, and the run time of every phase (class
images, training, validation renders) against the job's deadline. No torch here.
"""

from __future__ import annotations

import math

from fluxbooth.contract.precision import QUANTISED_PRECISIONS
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import describe_seconds
from fluxbooth.plan.types import Candidate, JobShape
from fluxbooth.request.limits import MAX_TIMEOUT_SECONDS
from fluxbooth.sizing import ModelSize, lora_target_suffixes, unmatched_lora_targets

DEADLINE_WARN_FRACTION = 0.8
# A deadline suggested in a refusal leaves this much room over the estimate.
DEADLINE_TIMEOUT_HEADROOM = 1.25
# A run predicted to take more than this share of its deadline checkpoints on its own, about this many times per run.
AUTO_CHECKPOINT_DEADLINE_FRACTION = 0.5
AUTO_CHECKPOINTS_PER_RUN = 4
# Phases that shrink to the time the deadline leaves them, never a reason to refuse a job: likeness scoring scores
# the newest validation steps it has time for and lists the rest as unscored.
SHRINKING_PHASES = ("scoring",)


def check_job(job: JobShape, model: ModelSize) -> None:
    """`invalid_input` for settings that cannot work with this model, before any planning."""
    if job.training_type == "full" and job.base_precision in QUANTISED_PRECISIONS:
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"base_precision: {job.base_precision!r} stores a frozen base, and a full fine-tune trains every "
            "weight; use training_type 'lora' with it, or base_precision 'auto' or 'bf16'",
        )
    if job.training_type == "lora" and job.base_precision in QUANTISED_PRECISIONS and job.zero_stage in (3, "3"):
        raise FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"zero_stage: a {job.base_precision} base stays whole on each GPU, and ZeRO-3 would partition it; "
            "use zero_stage 2 or 'auto', or base_precision 'bf16'",
        )
    if job.training_type == "lora" and job.lora_targets:
        unmatched = unmatched_lora_targets(model, job.lora_targets)
        if unmatched:
            raise FluxboothError(
                ErrorCode.INVALID_INPUT,
                f"lora_target_modules: {', '.join(repr(name) for name in unmatched)} match no Linear layer of "
                f"{model.name}'s transformer; valid names: {', '.join(lora_target_suffixes(model))}",
                details={"unmatched": unmatched},
            )


def _describe(candidate: Candidate) -> str:
    text = candidate.strategy.describe()
    return text.replace("LoRA", f"LoRA rank {candidate.lora_rank}", 1) if candidate.lora_rank is not None else text


def _remedies(candidate: Candidate, job: JobShape, deadline: float) -> list[str]:
    """The changes that would bring the run within the deadline, biggest phase first; never the
    strategy the job already uses, never a count below one."""
    phases = candidate.phase_seconds
    variable = ("training", "class_images", "validation", *SHRINKING_PHASES)
    budget = deadline - sum(seconds for name, seconds in phases.items() if name not in variable)
    remedies: list[tuple[float, str]] = []
    steps = steps_that_fit(candidate, deadline)
    if phases.get("training") and steps >= 1:
        remedies.append((phases["training"], f"about {steps} steps"))
    if phases.get("class_images") and job.num_class_images:
        per_image = phases["class_images"] / job.num_class_images
        affordable = int((budget - phases.get("training", 0.0) - phases.get("validation", 0.0)) / per_image)
        if affordable >= 1:
            remedies.append(
                (
                    phases["class_images"],
                    f"num_class_images about {affordable} (≈{per_image:.0f} s per "
                    "generated image; images in the zip's class/ folder are not generated)",
                )
            )
    if phases.get("validation"):
        text = f"fewer validation_prompts ({job.validation_prompts} now; [] renders none)"
        if job.validation_rounds_during_training:
            text += f" or a larger validation_steps ({job.validation_rounds} rounds of renders now)"
        remedies.append((phases["validation"], text))
    ordered = [text for _, text in sorted(remedies, reverse=True)]
    needed = timeout_that_fits(candidate)
    # Never the timeout the job already has: a job replanned after its dataset has less left than it was sent.
    if needed is not None and needed > max(deadline, job.timeout_seconds or 0):
        ordered.append(f"timeout_seconds {needed} (and an endpoint execution timeout above it)")
    if job.training_type == "full":
        ordered.append("training_type 'lora'")
    return ordered + ["a faster GPU"]


def steps_that_fit(candidate: Candidate, deadline: float) -> int:
    """The most optimizer steps that, with every other phase as planned (but those that shrink), finish before
    `deadline`."""
    others = sum(
        seconds for name, seconds in candidate.phase_seconds.items() if name not in ("training", *SHRINKING_PHASES)
    )
    return max(0, int((deadline - others) / max(candidate.seconds_per_step, 1e-9)))


def timeout_that_fits(candidate: Candidate) -> int | None:
    """A timeout_seconds (whole minutes) the run fits with room to spare; None beyond the request's maximum."""
    needed = math.ceil(candidate.total_seconds * DEADLINE_TIMEOUT_HEADROOM / 60) * 60
    return needed if needed <= MAX_TIMEOUT_SECONDS else None


def required_seconds(candidate: Candidate) -> float:
    """The run's predicted seconds without the phases that shrink to fit (SHRINKING_PHASES)."""
    return candidate.total_seconds - sum(candidate.phase_seconds.get(name, 0.0) for name in SHRINKING_PHASES)


def deadline_check(candidate: Candidate, job: JobShape, deadline_seconds: float | None) -> list[str]:
    """Refuse a run predicted to end after the deadline (every phase counted, the download and upload included,
    but those that shrink to fit), before anything is downloaded; warn when it comes close, or when a shrinking
    phase will be cut."""
    if not deadline_seconds:
        return []
    total = required_seconds(candidate)
    shown = ", ".join(
        f"{name.replace('_', ' ')} ≈{seconds / 60:.0f} min"
        for name, seconds in candidate.phase_seconds.items()
        if seconds >= 60 and name not in SHRINKING_PHASES
    )
    if total > deadline_seconds:
        raise FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"steps: {job.steps} steps at ≈{candidate.seconds_per_step:.1f} s/step with {_describe(candidate)}, "
            f"with every phase ({shown or 'each under a minute'}), take ≈{describe_seconds(total)}, beyond the job deadline of "
            f"{describe_seconds(deadline_seconds)}; use " + ", or ".join(_remedies(candidate, job, deadline_seconds)),
            details={
                "estimated_seconds": round(total),
                "deadline_seconds": round(deadline_seconds),
                "steps_that_fit": steps_that_fit(candidate, deadline_seconds),
                "timeout_that_fits": timeout_that_fits(candidate),
                "phase_seconds": {name: round(seconds) for name, seconds in candidate.phase_seconds.items()},
            },
        )
    scoring = candidate.phase_seconds.get("scoring", 0.0)
    if total + scoring > deadline_seconds:
        return [
            f"likeness: the job deadline leaves ≈{describe_seconds(max(0.0, deadline_seconds - total))} for scoring of "
            f"the ≈{describe_seconds(scoring)} it needs: it scores the validation steps it has time for and lists the "
            "rest as unscored; raise timeout_seconds to score every step"
        ]
    if total > deadline_seconds * DEADLINE_WARN_FRACTION:
        return [
            f"steps: the estimated run time (≈{total / 60:.0f} min at ≈{candidate.seconds_per_step:.1f} s/step, "
            f"{shown}) is close to the job deadline ({deadline_seconds / 60:.0f} min); the run may time out"
        ]
    return []


def auto_checkpointing(
    candidate: Candidate, job: JobShape, deadline_seconds: float | None
) -> tuple[int | None, list[str]]:
    """(checkpointing_steps, warnings): the request's own, or, for a run predicted to use more than half of its
    deadline, a checkpoint about every quarter of the run, said in a warning, so a run cut short keeps its work."""
    if job.checkpointing_steps or not deadline_seconds or job.steps < 2:
        return job.checkpointing_steps, []
    total = candidate.total_seconds
    if total <= deadline_seconds * AUTO_CHECKPOINT_DEADLINE_FRACTION:
        return None, []
    every = max(1, math.ceil(job.steps / AUTO_CHECKPOINTS_PER_RUN))
    return every, [
        f"checkpointing_steps: the run is predicted to take ≈{describe_seconds(total)} of its {describe_seconds(deadline_seconds)} "
        f"deadline (more than half), so it checkpoints every {every} steps on its own; a run cut short can be "
        'resubmitted with "resume_from": "latest"'
    ]
