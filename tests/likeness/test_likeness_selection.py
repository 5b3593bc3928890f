"""The selection rule on embeddings built by hand (fluxbooth.likeness.selection: numpy only, no models).

Cosine examples use 4-number vectors: four photos spread around the first axis (the "subject"), renders that
stray from it along the last axis, where no photo lies (so only an exact photo is near enough to be a copy);
the expected values are worked out in each test with plain numpy, independently of the module's helpers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fluxbooth.likeness.selection import (
    COPY_MARGIN_FRACTION,
    DLIB_MATCH_DISTANCE,
    ONE_PHOTO_COPY_SIMILARITY,
    PROMPT_FIDELITY_TOLERANCE,
    StepEmbeddings,
    score_steps,
)

PHOTOS = np.array([[1.0, 0.5, 0.0, 0.0], [1.0, -0.5, 0.0, 0.0], [1.0, 0.0, 0.5, 0.0], [1.0, 0.0, -0.5, 0.0]])
FALLBACK = (0.0, "no base renders (test)")
OFF_AXIS = np.array([0.2, 0.0, 0.0, 1.0])  # a render of something else


def like(stray: float) -> np.ndarray:
    """A render of the subject that strays `stray` from the photos' centre, away from every photo."""
    return np.array([1.0, 0.0, 0.0, stray])


def unit(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def cos(first: np.ndarray, second: np.ndarray) -> float:
    return float(unit(first) @ unit(second))


def step(
    number: int,
    *renders: np.ndarray | None,
    fidelity: tuple[float, ...] | None = None,
    variety: np.ndarray | None = None,
) -> StepEmbeddings:
    return StepEmbeddings(number, tuple(renders), fidelity, variety)


def run(steps: list[StepEmbeddings], photos: np.ndarray = PHOTOS, keep: bool = True, **options: object):
    return score_steps("cosine", photos, steps, faces=False, keep_best_step=keep, fallback_zero=FALLBACK, **options)


def entry(scored, number: int) -> dict:
    return next(item for item in scored.steps if item["step"] == number)


def test_zero_is_the_base_renders_similarity_and_one_the_photos_leave_one_out() -> None:
    scored = run([step(0, OFF_AXIS, OFF_AXIS), step(100, PHOTOS[0])])
    centre = np.mean([unit(photo) for photo in PHOTOS], axis=0)
    loo = np.mean(
        [cos(PHOTOS[i], np.mean([unit(p) for j, p in enumerate(PHOTOS) if j != i], axis=0)) for i in range(4)]
    )
    assert scored.calibration.zero == pytest.approx(cos(OFF_AXIS, centre))
    assert scored.calibration.one == pytest.approx(loo)
    assert scored.calibration.zero_source == "the base model's renders at step 0"
    assert scored.calibration.one_source == "the 4 training photos to each other (leave-one-out)"


def test_likeness_is_zero_for_base_like_renders_and_one_for_renders_as_alike_as_the_photos() -> None:
    scored = run([step(0, OFF_AXIS), step(100, OFF_AXIS)])
    assert entry(scored, 0)["likeness"] == 0.0 and entry(scored, 100)["likeness"] == 0.0
    calibration = scored.calibration
    centre = np.mean([unit(photo) for photo in PHOTOS], axis=0)
    expected = (cos(PHOTOS[0], centre) - calibration.zero) / (calibration.one - calibration.zero)
    assert entry(run([step(0, OFF_AXIS), step(100, PHOTOS[0])]), 100)["likeness"] == pytest.approx(expected, abs=1e-4)


def test_a_render_at_the_copy_similarity_to_one_photo_is_a_copy_and_a_nearer_photo_like_render_is_not() -> None:
    closest = max(cos(PHOTOS[i], PHOTOS[j]) for i in range(4) for j in range(4) if i != j)
    threshold = closest + COPY_MARGIN_FRACTION * (1 - closest)
    centre = like(0.0)  # like the photos, but none of them
    scored = run([step(0, OFF_AXIS), step(100, PHOTOS[1].copy(), centre)])
    assert scored.calibration.copy_similarity == pytest.approx(threshold)
    assert max(cos(centre, photo) for photo in PHOTOS) < threshold
    assert entry(scored, 100)["copies"] == 1


def test_copies_on_more_than_a_quarter_of_the_renders_fail_the_copies_guard() -> None:
    one_in_four = run([step(0, OFF_AXIS), step(100, PHOTOS[0], like(0.1), like(0.2), like(0.3))])
    two_in_four = run([step(0, OFF_AXIS), step(100, PHOTOS[0], PHOTOS[1], like(0.2), like(0.3))])
    assert entry(one_in_four, 100)["failed_guards"] == [] and entry(one_in_four, 100)["eligible"]
    assert entry(two_in_four, 100)["failed_guards"] == ["copies"] and not entry(two_in_four, 100)["eligible"]


def test_prompt_fidelity_more_than_the_tolerance_below_step_0_fails_its_guard() -> None:
    base = step(0, OFF_AXIS, OFF_AXIS, fidelity=(5.0, 5.0))
    kept = step(100, like(0.1), like(0.2), fidelity=(5.0 - PROMPT_FIDELITY_TOLERANCE + 0.1,) * 2)
    lost = step(200, like(0.1), like(0.2), fidelity=(5.0 - PROMPT_FIDELITY_TOLERANCE - 0.1,) * 2)
    scored = run([base, kept, lost])
    assert entry(scored, 100)["prompt_fidelity_change"] == pytest.approx(-PROMPT_FIDELITY_TOLERANCE + 0.1)
    assert entry(scored, 100)["failed_guards"] == []
    assert entry(scored, 200)["failed_guards"] == ["prompt_fidelity"]


def test_variety_that_lost_more_than_half_of_step_0s_dissimilarity_fails_its_guard() -> None:
    varied = np.eye(3)  # pairwise cosine 0: dissimilarity 1
    kept = np.array([[1.0, 0.9, 0.0], [1.0, -0.9, 0.0], [1.0, 0.0, 0.9]])  # still more than half as dissimilar
    collapsed = np.array([[1.0, 0.1, 0.0], [1.0, -0.1, 0.0], [1.0, 0.0, 0.1]])
    scored = run(
        [step(0, OFF_AXIS, variety=varied), step(100, like(0.1), variety=kept), step(200, like(0.1), variety=collapsed)]
    )
    assert entry(scored, 0)["variety"] == 0.0
    assert 1 - entry(scored, 100)["variety"] > 0.5 and entry(scored, 100)["failed_guards"] == []
    assert entry(scored, 200)["failed_guards"] == ["variety"]


def test_the_earliest_step_within_one_standard_error_of_the_best_is_chosen() -> None:
    steps = [
        step(0, OFF_AXIS, OFF_AXIS),
        step(100, like(1.0), like(1.0)),
        step(200, like(0.2), like(0.3)),
        step(300, like(0.0), like(0.35)),
        step(400, like(0.6), like(0.6)),
    ]
    scored = run(steps)
    likeness = {item["step"]: item["likeness"] for item in scored.steps}
    best = max(range(100, 500, 100), key=lambda number: likeness[number])
    floor = likeness[best] - entry(scored, best)["likeness_se"]
    expected = min(number for number in range(100, 500, 100) if likeness[number] >= floor)
    assert expected < best  # the rule prefers an earlier step that is as good within the noise
    assert scored.choice.step == expected and entry(scored, expected)["selected"]
    assert [item["step"] for item in scored.steps if item["selected"]] == [expected]
    assert scored.choice.sentence.startswith(f"Chosen: step {expected} is the earliest step")


def test_no_eligible_step_chooses_nothing_and_says_which_guard_failed_on_which_steps() -> None:
    scored = run([step(0, OFF_AXIS), step(100, PHOTOS[0], PHOTOS[1]), step(200, None, None)])
    assert scored.choice.step is None
    assert not any(item["selected"] for item in scored.steps)
    assert scored.choice.sentence == (
        "No step was chosen, the final weights stay main: every validation step failed a "
        "guard: copies (step 100); unscored (step 200)"
    )


def test_keep_best_step_off_selects_nothing_but_names_the_step_the_rule_picks() -> None:
    scored = run([step(0, OFF_AXIS), step(100, like(0.1))], keep=False)
    assert scored.choice.step is None and scored.choice.best_by_rule == 100
    assert scored.choice.sentence.startswith(
        "keep_best_step is off, so the final weights stay main; by the rule, step 100"
    )


def test_the_base_model_step_is_never_eligible() -> None:
    assert entry(run([step(0, like(0.0)), step(100, OFF_AXIS)]), 0)["failed_guards"] == ["base model"]


def test_one_training_photo_leaves_one_null_and_reports_the_raw_similarity() -> None:
    photo = PHOTOS[:1]
    render = like(0.5)
    scored = run([step(0, OFF_AXIS), step(100, render)], photos=photo)
    assert scored.calibration.one is None and not scored.calibration.calibrated
    assert scored.calibration.one_source == "one training photo: no leave-one-out is possible"
    assert scored.calibration.copy_similarity == ONE_PHOTO_COPY_SIMILARITY
    assert entry(scored, 100)["likeness"] == pytest.approx(cos(render, PHOTOS[0]), abs=1e-4)
    assert entry(run([step(0, OFF_AXIS), step(100, PHOTOS[0].copy())], photos=photo), 100)["copies"] == 1


def test_a_zero_not_below_the_one_leaves_the_scale_uncalibrated_instead_of_dividing_by_it() -> None:
    scored = run([step(0, *PHOTOS), step(100, like(0.1))])
    assert not scored.calibration.calibrated
    assert "uncalibrated" in scored.calibration.scale
    assert all(item["likeness"] is None or math.isfinite(item["likeness"]) for item in scored.steps)


def test_without_base_renders_the_fallback_zero_is_used_and_named() -> None:
    scored = run([step(100, like(0.1))])
    assert (scored.calibration.zero, scored.calibration.zero_source) == FALLBACK


def test_an_undetected_face_lowers_the_detect_rate_and_is_never_scored_as_zero() -> None:
    descriptors = np.array([[0.0, 0.0], [0.2, 0.0], [0.0, 0.2]])
    near, stranger = np.array([0.05, 0.05]), np.array([0.9, 0.0])
    scored = score_steps(
        "euclidean",
        descriptors,
        [step(0, stranger), step(100, near, None)],
        faces=True,
        keep_best_step=True,
        fallback_zero=FALLBACK,
    )
    faces_only = score_steps(
        "euclidean",
        descriptors,
        [step(0, stranger), step(100, near)],
        faces=True,
        keep_best_step=True,
        fallback_zero=FALLBACK,
    )
    assert entry(scored, 100)["face_detect_rate"] == 0.5 and entry(faces_only, 100)["face_detect_rate"] == 1.0
    assert entry(scored, 100)["likeness"] == entry(faces_only, 100)["likeness"]
    assert entry(scored, 100)["face_match_rate"] == 1.0  # within dlib's 0.6 of the photos' centroid
    assert entry(scored, 0)["face_match_rate"] == (
        0.0 if np.linalg.norm(stranger - descriptors.mean(0)) > DLIB_MATCH_DISTANCE else 1.0
    )


def test_a_step_whose_renders_hold_no_face_is_unscored_with_null_likeness() -> None:
    scored = score_steps(
        "euclidean",
        np.zeros((2, 2)) + [[0, 0], [0.1, 0]],
        [step(0, None), step(100, None, None)],
        faces=True,
        keep_best_step=True,
        fallback_zero=FALLBACK,
    )
    assert entry(scored, 100)["likeness"] is None and entry(scored, 100)["face_detect_rate"] == 0.0
    assert entry(scored, 100)["failed_guards"] == ["unscored"]


def test_steps_skipped_for_the_deadline_are_listed_unscored_and_never_eligible() -> None:
    scored = run([step(0, OFF_AXIS), step(300, like(0.1))], unscored={100: 2, 200: 2})
    assert [item["step"] for item in scored.steps] == [0, 100, 200, 300]
    assert entry(scored, 100)["failed_guards"] == ["unscored"] and entry(scored, 100)["renders"] == 2
    assert scored.choice.step == 300


# ---- a choice within the scores' noise keeps the final weights ------------------------------------------------------


def test_an_earlier_step_within_the_noise_of_the_final_step_keeps_the_final_weights() -> None:
    scored = run([step(0, OFF_AXIS, OFF_AXIS), step(100, like(0.1), like(0.3)), step(200, like(0.12), like(0.32))])
    first, final = entry(scored, 100), entry(scored, 200)
    noise = math.hypot(first["likeness_se"], final["likeness_se"])
    assert 0 < first["likeness"] - final["likeness"] <= noise  # step 100 is the rule's pick, by less than the noise
    assert scored.choice.step == 200 and final["selected"] and not first["selected"]
    assert scored.choice.sentence.startswith(
        f"Final weights kept: the final step 200's likeness ({final['likeness']:.3f}) is within the scores' noise "
        f"({noise:.3f}) of step 100's ({first['likeness']:.3f}), the earliest within one standard error of the best"
    )


def test_steps_of_one_render_apart_by_less_than_the_photos_spread_keep_the_final_weights() -> None:
    # One photo further out than the others: the photos' leave-one-out similarities spread.
    photos = np.array([[1.0, 0.5, 0.0, 0.0], [1.0, -0.5, 0.0, 0.0], [1.0, 0.0, 0.5, 0.0], [1.0, 0.0, -0.9, 0.0]])
    scored = run([step(0, OFF_AXIS), step(100, like(0.1)), step(200, like(0.12))], photos=photos)
    assert entry(scored, 100)["likeness"] > entry(scored, 200)["likeness"]
    assert entry(scored, 100)["likeness_se"] is None  # one render: the photos' spread stands in for the noise
    assert scored.choice.step == 200
    assert scored.choice.sentence.startswith("Final weights kept: the final step 200's likeness")


def test_steps_of_one_render_further_apart_than_the_photos_spread_choose_the_earlier_step() -> None:
    photos = np.array([[1.0, 0.5, 0.0, 0.0], [1.0, -0.5, 0.0, 0.0], [1.0, 0.0, 0.5, 0.0], [1.0, 0.0, -0.9, 0.0]])
    scored = run([step(0, OFF_AXIS), step(100, like(0.0)), step(200, like(1.0))], photos=photos)
    assert scored.choice.step == 100


def test_an_earlier_step_clearly_better_than_the_final_step_is_still_chosen() -> None:
    scored = run([step(0, OFF_AXIS, OFF_AXIS), step(100, like(0.0), like(0.05)), step(200, like(1.0), like(1.05))])
    assert scored.choice.step == 100
    assert scored.choice.sentence.startswith("Chosen: step 100 is the earliest step")


def test_with_one_photo_and_one_render_a_step_the_noise_cannot_separate_keeps_the_final_weights() -> None:
    scored = run([step(0, OFF_AXIS), step(100, like(0.1)), step(200, like(0.2))], photos=PHOTOS[:1])
    assert scored.choice.step == 200
    assert scored.choice.sentence.startswith("Final weights kept: step 100 (") and scored.choice.sentence.endswith(
        "cannot be told apart: their noise is not measured (one render each and fewer than two photos), so the "
        "final weights stay"
    )


def test_keep_best_step_off_names_the_final_step_when_the_choice_is_within_the_noise() -> None:
    scored = run(
        [step(0, OFF_AXIS, OFF_AXIS), step(100, like(0.1), like(0.3)), step(200, like(0.12), like(0.32))], keep=False
    )
    assert scored.choice.step is None and scored.choice.best_by_rule == 200
    assert scored.choice.sentence.startswith(
        "keep_best_step is off, so the final weights stay main; by the rule, the final step 200's likeness"
    )
