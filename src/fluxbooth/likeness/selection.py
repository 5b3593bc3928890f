"""The likeness numbers and the choice of a step, from embeddings alone (numpy; no torch, no images).

Similarity: faces use dlib's own metric, one minus the Euclidean distance between descriptors (so dlib's
published 0.6 same-person distance is a similarity of 0.4); images use the cosine of their embeddings. Every
number below is a similarity on one of these two scales, highest 1 (the same image).

- **calibration**: zero is the base model's renders' mean similarity to the photos' centroid; one is the photos'
  own leave-one-out similarity (each photo to the centroid of the others). A render's likeness is
  (similarity - zero) / (one - zero). One photo gives no leave-one-out: one is null and likeness stays the raw
  similarity (the calibration says so); so does a scale whose one is not clearly above its zero.
- **copies**: a render is a copy when its similarity to one training photo reaches `copy_similarity`: the two
  closest photos' similarity plus half of what is left to an identical image (COPY_MARGIN_FRACTION).
- **guards**: copies on at most a quarter of a step's renders; mean prompt fidelity (SigLIP logit) at most
  PROMPT_FIDELITY_TOLERANCE below step 0's; variety not collapsed (the renders' mean pairwise dissimilarity at
  least half of step 0's). A guard that cannot be measured (its model unavailable, one render) is not applied.
- **choice**: the earliest eligible step whose likeness is within one standard error of the best eligible step's,
  unless the final step is eligible and within the scores' noise of it: the final weights then stay (the scores
  cannot tell the two apart, and swapping weights on noise only makes the result harder to reproduce).
- **noise**: the standard error of the difference between two steps' likeness, sqrt(se_a² + se_b²), each step's
  standard error over its scored renders; a step with one scored render has none, so it takes the spread one
  image of the subject shows, the standard deviation of the photos' leave-one-out similarities on the likeness
  scale. Where neither is measured (one photo, one render) the noise is unknown and the final weights stay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fluxbooth.contract.scoring import BASE_STEP

Metric = Literal["cosine", "euclidean"]  # the similarity: cosine, or 1 - Euclidean distance (dlib's faces)
# dlib's published threshold: two face descriptors closer than this are the same person (99.38% on LFW).
DLIB_MATCH_DISTANCE = 0.6
# A copy reaches past the two closest training photos' similarity by half the rest of the way to an identical image.
COPY_MARGIN_FRACTION = 0.5
# With one training photo there are no two photos to compare: a render this similar to it is a copy (a stated
# choice: on dlib's scale a distance of 0.1, nearer than JPEG or recolouring moves a photo; for DINOv2, above
# the 0.77 that DreamBooth reports between real photos of one subject).
ONE_PHOTO_COPY_SIMILARITY = 0.9
# Guards (stated choices, not fitted to data).
MAX_COPY_SHARE = 0.25  # copies on at most a quarter of a step's renders
PROMPT_FIDELITY_TOLERANCE = 2.0  # SigLIP logits the step's mean may fall below step 0's (odds of the prompt / e^2)
VARIETY_KEPT_FRACTION = 0.5  # the renders' mean pairwise dissimilarity must keep half of step 0's
# A scale whose one is less than this above its zero cannot be calibrated (the base model is already as alike).
MIN_SCALE_SPREAD = 0.01
GUARD_COPIES, GUARD_FIDELITY, GUARD_VARIETY = "copies", "prompt_fidelity", "variety"
GUARD_BASE, GUARD_UNSCORED = "base model", "unscored"


@dataclass(frozen=True)
class StepEmbeddings:
    """What one step's renders gave: one likeness embedding per render (None: no face, or not scorable), the
    SigLIP logit per render (None: not measured) and whole-image embeddings for variety (None: not measured)."""

    step: int
    likeness: tuple[np.ndarray | None, ...]
    fidelity: tuple[float, ...] | None = None
    variety: np.ndarray | None = None

    @property
    def renders(self) -> int:
        return len(self.likeness)

    def scored(self) -> np.ndarray:
        vectors = [vector for vector in self.likeness if vector is not None]
        return np.stack(vectors) if vectors else np.zeros((0, 0))


@dataclass(frozen=True)
class Calibration:
    zero: float
    zero_source: str
    one: float | None
    one_source: str
    copy_similarity: float
    calibrated: bool  # False: likeness is the raw similarity (see `scale`)
    scale: str

    def apply(self, similarity: float) -> float:
        if not self.calibrated or self.one is None:
            return similarity
        return (similarity - self.zero) / (self.one - self.zero)

    def to_json(self) -> dict[str, Any]:
        return {
            "zero": _round(self.zero),
            "zero_source": self.zero_source,
            "one": _round(self.one),
            "one_source": self.one_source,
            "copy_similarity": _round(self.copy_similarity),
            "scale": self.scale,
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None or not math.isfinite(value) else round(float(value), digits)


# ------------------------------------------------------------------------------------------ similarities


def _unit(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.where(norms > 0, norms, 1.0)


def pairwise_similarity(metric: Metric, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Similarity of every row of `first` to every row of `second` (rows are embeddings)."""
    first, second = np.atleast_2d(np.asarray(first, float)), np.atleast_2d(np.asarray(second, float))
    if metric == "cosine":
        return _unit(first) @ _unit(second).T
    return 1.0 - np.linalg.norm(first[:, None, :] - second[None, :, :], axis=-1)


def centroid(metric: Metric, rows: np.ndarray) -> np.ndarray:
    """The photos' centre: the mean of unit vectors for cosine, of raw descriptors for dlib's metric."""
    rows = np.atleast_2d(np.asarray(rows, float))
    return (_unit(rows) if metric == "cosine" else rows).mean(axis=0)


def similarity_to_centroid(metric: Metric, rows: np.ndarray, photos: np.ndarray) -> np.ndarray:
    return pairwise_similarity(metric, rows, centroid(metric, photos)[None, :])[:, 0]


def _leave_one_out_scores(metric: Metric, photos: np.ndarray) -> list[float]:
    """Each photo's similarity to the centroid of the others (none for fewer than two photos)."""
    if len(photos) < 2:
        return []
    return [
        float(similarity_to_centroid(metric, photos[index : index + 1], np.delete(photos, index, axis=0))[0])
        for index in range(len(photos))
    ]


def leave_one_out(metric: Metric, photos: np.ndarray) -> float | None:
    """The photos' mean similarity, each to the centroid of the others; None for fewer than two photos."""
    scores = _leave_one_out_scores(metric, photos)
    return float(np.mean(scores)) if scores else None


def photo_spread(metric: Metric, photos: np.ndarray, calibration: Calibration) -> float | None:
    """The spread one image of the subject shows on the likeness scale: the standard deviation of the photos'
    leave-one-out similarities (scaled as `calibration` scales a similarity); None for fewer than two photos."""
    scores = _leave_one_out_scores(metric, photos)
    if len(scores) < 2:
        return None
    spread = float(np.std(scores, ddof=1))
    if calibration.calibrated and calibration.one is not None:
        spread /= calibration.one - calibration.zero
    return spread


def copy_similarity(metric: Metric, photos: np.ndarray) -> float:
    """The similarity to one photo at which a render counts as a copy of it (see the module docstring)."""
    if len(photos) < 2:
        return ONE_PHOTO_COPY_SIMILARITY
    pairs = pairwise_similarity(metric, photos, photos)
    closest = float(pairs[~np.eye(len(photos), dtype=bool)].max())
    return closest + COPY_MARGIN_FRACTION * (1.0 - closest)


def calibrate(
    metric: Metric, photos: np.ndarray, base: StepEmbeddings | None, fallback_zero: tuple[float, str]
) -> Calibration:
    """The scale: zero from the base renders (else `fallback_zero`, a value and what it is), one from the photos."""
    base_scored = base.scored() if base is not None else np.zeros((0, 0))
    if len(base_scored):
        zero = float(similarity_to_centroid(metric, base_scored, photos).mean())
        zero_source = "the base model's renders at step 0"
    else:
        zero, zero_source = fallback_zero
    one = leave_one_out(metric, photos)
    copies = copy_similarity(metric, photos)
    if one is None:
        return Calibration(
            zero,
            zero_source,
            None,
            "one training photo: no leave-one-out is possible",
            copies,
            False,
            "raw similarity to the one training photo (uncalibrated)",
        )
    one_source = f"the {len(photos)} training photos to each other (leave-one-out)"
    if one - zero < MIN_SCALE_SPREAD:
        return Calibration(
            zero,
            zero_source,
            one,
            one_source,
            copies,
            False,
            "raw similarity to the photos' centroid (uncalibrated: the zero is not below the one)",
        )
    return Calibration(zero, zero_source, one, one_source, copies, True, "calibrated: 0 = zero, 1 = one")


# ------------------------------------------------------------------------------------------ one step


@dataclass(frozen=True)
class StepScore:
    step: int
    renders: int
    likeness: float | None
    likeness_se: float | None
    face_detect_rate: float | None
    face_match_rate: float | None
    copies: int
    prompt_fidelity: float | None
    variety: float | None


def _mean_and_se(values: np.ndarray) -> tuple[float | None, float | None]:
    if len(values) == 0:
        return None, None
    se = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None
    return float(np.mean(values)), se


def mean_pairwise(metric: Metric, rows: np.ndarray | None) -> float | None:
    """Mean similarity over distinct pairs of rows; None for fewer than two rows."""
    if rows is None or len(rows) < 2:
        return None
    pairs = pairwise_similarity(metric, rows, rows)
    return float(pairs[~np.eye(len(rows), dtype=bool)].mean())


def score_step(
    metric: Metric, photos: np.ndarray, step: StepEmbeddings, calibration: Calibration, faces: bool
) -> StepScore:
    """The step's numbers: calibrated likeness over its scored renders, face rates (persons), copies, fidelity, variety."""
    scored = step.scored()
    to_centroid = similarity_to_centroid(metric, scored, photos) if len(scored) else np.zeros(0)
    likeness, se = _mean_and_se(np.array([calibration.apply(value) for value in to_centroid]))
    copies = (
        int((pairwise_similarity(metric, scored, photos).max(axis=1) >= calibration.copy_similarity).sum())
        if len(scored)
        else 0
    )
    detect_rate = match_rate = None
    if faces:
        detect_rate = len(scored) / step.renders if step.renders else None
        match_rate = float(np.mean(to_centroid >= 1.0 - DLIB_MATCH_DISTANCE)) if len(scored) else None
    fidelity = float(np.mean(step.fidelity)) if step.fidelity else None
    variety = mean_pairwise("cosine", step.variety)
    return StepScore(step.step, step.renders, likeness, se, detect_rate, match_rate, copies, fidelity, variety)


def failed_guards(score: StepScore, base: StepScore | None) -> list[str]:
    """The guards `score` fails, against the base model's step; step 0 itself is never eligible."""
    if score.step == BASE_STEP:
        return [GUARD_BASE]
    failed = [GUARD_UNSCORED] if score.likeness is None else []
    if score.renders and score.copies > MAX_COPY_SHARE * score.renders:
        failed.append(GUARD_COPIES)
    if base is not None and score.prompt_fidelity is not None and base.prompt_fidelity is not None:
        if score.prompt_fidelity < base.prompt_fidelity - PROMPT_FIDELITY_TOLERANCE:
            failed.append(GUARD_FIDELITY)
    if base is not None and score.variety is not None and base.variety is not None:
        if 1.0 - score.variety < VARIETY_KEPT_FRACTION * (1.0 - base.variety):
            failed.append(GUARD_VARIETY)
    return failed


# ------------------------------------------------------------------------------------------ the choice


@dataclass(frozen=True)
class Choice:
    step: int | None  # the chosen step (keep_best_step), or None
    best_by_rule: int | None  # the step the rule picks, whether or not the request keeps it
    sentence: str


def _difference_noise(first: StepScore, second: StepScore, spread: float | None) -> float | None:
    """The standard error of the difference of two steps' likeness (module docstring, **noise**); None: unknown."""
    errors = [score.likeness_se if score.likeness_se is not None else spread for score in (first, second)]
    if any(error is None for error in errors):
        return None
    return math.sqrt(sum(error * error for error in errors if error is not None))


def _final_within_noise(
    chosen: StepScore, eligible: Sequence[StepScore], scores: Sequence[StepScore], spread: float | None
) -> str | None:
    """Why the final weights stay instead of `chosen`'s (the final step eligible and within the noise of it), or
    None when `chosen` is the final step or clearly better than it."""
    final = max((score for score in scores if score.step != BASE_STEP), key=lambda score: score.step)
    if final.step == chosen.step or final not in eligible:
        return None
    assert chosen.likeness is not None and final.likeness is not None  # eligible steps are scored
    noise = _difference_noise(chosen, final, spread)
    if noise is None:
        return (
            f"step {chosen.step} ({chosen.likeness:.3f}) and the final step {final.step} ({final.likeness:.3f}) "
            "cannot be told apart: their noise is not measured (one render each and fewer than two photos), so "
            "the final weights stay"
        )
    if chosen.likeness - final.likeness > noise:
        return None
    return (
        f"the final step {final.step}'s likeness ({final.likeness:.3f}) is within the scores' noise ({noise:.3f}) "
        f"of step {chosen.step}'s ({chosen.likeness:.3f}), the earliest within one standard error of the best, so "
        "the final weights stay"
    )


def choose(
    scores: Sequence[StepScore], guards: dict[int, list[str]], keep_best_step: bool, spread: float | None = None
) -> Choice:
    """The earliest eligible step within one standard error of the best eligible step's likeness, or the final
    step where that choice is within the noise of it (`spread`: photo_spread)."""
    eligible = [score for score in scores if not guards[score.step]]
    if not eligible:
        return Choice(None, None, _none_eligible(guards))
    best = max(eligible, key=lambda score: score.likeness or 0.0)
    assert best.likeness is not None  # eligible steps are scored
    floor = best.likeness - (best.likeness_se or 0.0)
    chosen = min((score for score in eligible if (score.likeness or 0.0) >= floor), key=lambda score: score.step)
    reason = (
        f"step {chosen.step} is the earliest step whose likeness ({chosen.likeness:.3f}) is within one standard "
        f"error ({best.likeness_se or 0.0:.3f}) of the best, step {best.step} ({best.likeness:.3f}), among the "
        f"{len(eligible)} steps that pass the guards (copies, prompt fidelity, variety)"
    )
    kept_final = _final_within_noise(chosen, eligible, scores, spread)
    if kept_final is not None:
        final = max(score.step for score in scores if score.step != BASE_STEP)
        if not keep_best_step:
            return Choice(
                None, final, f"keep_best_step is off, so the final weights stay main; by the rule, {kept_final}"
            )
        return Choice(final, final, f"Final weights kept: {kept_final}")
    if not keep_best_step:
        return Choice(
            None, chosen.step, f"keep_best_step is off, so the final weights stay main; by the rule, {reason}"
        )
    return Choice(chosen.step, chosen.step, f"Chosen: {reason}")


def _none_eligible(guards: dict[int, list[str]]) -> str:
    """Which guard failed, with the steps it failed on (`guards` holds unscored steps too)."""
    trained = sorted(step for step in guards if step != BASE_STEP)
    if not trained:
        return "No step was chosen: there is no validation step after the base model's renders"
    by_guard: dict[str, list[int]] = {}
    for step in trained:
        for guard in guards[step]:
            by_guard.setdefault(guard, []).append(step)
    failures = "; ".join(
        f"{guard.replace('_', ' ')} (step{'s' if len(steps) > 1 else ''} {', '.join(str(step) for step in steps)})"
        for guard, steps in by_guard.items()
    )
    return f"No step was chosen, the final weights stay main: every validation step failed a guard: {failures}"


def step_json(score: StepScore, guards: list[str], selected: bool, base: StepScore | None) -> dict[str, Any]:
    """One entry of the section's `steps`."""
    change = None
    if base is not None and score.prompt_fidelity is not None and base.prompt_fidelity is not None:
        change = score.prompt_fidelity - base.prompt_fidelity
    return {
        "step": score.step,
        "renders": score.renders,
        "likeness": _round(score.likeness),
        "likeness_se": _round(score.likeness_se),
        "face_detect_rate": _round(score.face_detect_rate),
        "face_match_rate": _round(score.face_match_rate),
        "copies": score.copies,
        "prompt_fidelity": _round(score.prompt_fidelity),
        "prompt_fidelity_change": _round(change),
        "variety": _round(score.variety),
        "eligible": not guards,
        "failed_guards": guards,
        "selected": selected,
    }


def unscored_step_json(step: int, renders: int) -> dict[str, Any]:
    """A step skipped for the deadline: listed, never eligible."""
    return {
        "step": step,
        "renders": renders,
        "likeness": None,
        "likeness_se": None,
        "face_detect_rate": None,
        "face_match_rate": None,
        "copies": 0,
        "prompt_fidelity": None,
        "prompt_fidelity_change": None,
        "variety": None,
        "eligible": False,
        "failed_guards": [GUARD_UNSCORED],
        "selected": False,
    }


@dataclass(frozen=True)
class Scored:
    """The section's scored part: calibration, steps (step order), the choice."""

    calibration: Calibration
    steps: list[dict[str, Any]]
    choice: Choice


def score_steps(
    metric: Metric,
    photos: np.ndarray,
    steps: Sequence[StepEmbeddings],
    *,
    faces: bool,
    keep_best_step: bool,
    fallback_zero: tuple[float, str],
    unscored: dict[int, int] | None = None,
) -> Scored:
    """Everything the section says about the steps. `steps` holds BASE_STEP when the base renders were made;
    `unscored` maps each step skipped for the deadline to its render count."""
    by_step = {step.step: step for step in steps}
    calibration = calibrate(metric, photos, by_step.get(BASE_STEP), fallback_zero)
    scores = [score_step(metric, photos, by_step[number], calibration, faces) for number in sorted(by_step)]
    base = next((score for score in scores if score.step == BASE_STEP), None)
    guards = {score.step: failed_guards(score, base) for score in scores}
    guards.update({step: [GUARD_UNSCORED] for step in unscored or {}})
    choice = choose(scores, guards, keep_best_step, photo_spread(metric, photos, calibration))
    entries = {score.step: step_json(score, guards[score.step], score.step == choice.step, base) for score in scores}
    entries.update({step: unscored_step_json(step, renders) for step, renders in (unscored or {}).items()})
    return Scored(calibration, [entries[step] for step in sorted(entries)], choice)
