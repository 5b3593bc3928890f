"""Where a user sees the likeness scores in the report: report/likeness.png (the scores against step, the chosen
step marked) drawn from a scored section only, and the samples sheet's chosen row framed.

The sections are built by hand in the shape fluxbooth.likeness writes (status, steps, selected_step); the
renders and events as in tests/report/test_report.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fluxbooth.contract.budgets import MAX_SHOWN_ROUNDS
from fluxbooth.contract.scoring import PROXY_NOTE, unavailable_section
from fluxbooth.report import ReportInputs, make_report, report_artifacts
from fluxbooth.report.history import history_from
from fluxbooth.report.likeness import FIGURE_INCHES, chosen_step, gap_note
from fluxbooth.report.loss import DPI
from fluxbooth.report.sheets import CHOSEN_INK, LABEL_WIDTH, MARGIN, SAMPLES_HEADER, TITLE_SIZE, samples_size
from tests.support.photos import png_size
from tests.support.report_inputs import PROMPTS, sheet_of, step_events, write_renders

PLOT_SIZE = (round(FIGURE_INCHES[0] * DPI), round(FIGURE_INCHES[1] * DPI))


def step_record(
    step: int, likeness: float | None, *, selected: bool = False, face_detect_rate: float | None = 1.0
) -> dict[str, Any]:
    scored = likeness is not None
    return {
        "step": step,
        "renders": len(PROMPTS),
        "likeness": likeness,
        "likeness_se": 0.05 if scored else None,
        "face_detect_rate": face_detect_rate,
        "face_match_rate": 0.5 if scored else None,
        "copies": 0,
        "prompt_fidelity": 0.12 if scored else None,
        "prompt_fidelity_change": -0.01 * step if scored else None,
        "variety": 0.4 + 0.01 * step if scored else None,
        "eligible": selected,
        "failed_guards": [] if selected else ["base model"],
        "selected": selected,
    }


def scored_section(steps: list[dict[str, Any]], selected_step: int | None) -> dict[str, Any]:
    return {
        "status": "scored",
        "subject_type": "person",
        "subject_type_source": "request",
        "models": [],
        "calibration": {
            "zero": 0.1,
            "zero_source": "the base model's renders at step 0",
            "one": 0.7,
            "one_source": "the 8 training photos to each other (leave-one-out)",
            "copy_similarity": 0.9,
        },
        "steps": steps,
        "selected_step": selected_step,
        "selection": f"step {selected_step}: the earliest within one standard error of the best"
        if selected_step is not None
        else "no step passed",
        "unscored_steps": [],
        "unscored_reason": None,
        "note": PROXY_NOTE,
    }


def report_with(
    tmp_path: Path, likeness: dict[str, Any] | None, *, rounds: list[int], final_step: int
) -> tuple[Path, list[str], list[str]]:
    output_dir = tmp_path / "output"
    write_renders(output_dir, rounds=rounds, final_step=final_step)
    report = make_report(
        ReportInputs(
            "sks-person",
            step_events(final_step),
            output_dir,
            sheet_of(tmp_path / "instance", 2),
            lambda width, height: (64, 64),
            likeness,
        )
    )
    return (
        output_dir / "report",
        [artifact.name for artifact in report_artifacts(report, output_dir)],
        list(report.warnings),
    )


def chosen_ink_rows(path: Path) -> set[int]:
    """The pixel rows that hold the chosen step's colour exactly."""
    pixels = np.asarray(Image.open(path).convert("RGB"))
    return set(np.nonzero((pixels == CHOSEN_INK).all(axis=-1))[0].tolist())


def sample_row_band(row: int, rows: int) -> range:
    """The pixel rows of one samples row, with the margin half above and below its tiles."""
    _, _, tile = samples_size(rows, len(PROMPTS))
    top = TITLE_SIZE + 2 * MARGIN + SAMPLES_HEADER + row * (tile + MARGIN)
    return range(top - MARGIN // 2 - 1, top + tile + MARGIN // 2 + 1)


def test_a_scored_section_draws_likeness_png_as_a_report_artifact(tmp_path: Path) -> None:
    section = scored_section(
        [step_record(0, 0.0), step_record(2, 0.4), step_record(4, 0.7, selected=True), step_record(5, 0.8)], 4
    )
    folder, names, warnings = report_with(tmp_path, section, rounds=[0, 2, 4], final_step=5)

    assert warnings == []
    assert "report/likeness.png" in names
    assert png_size(folder / "likeness.png") == PLOT_SIZE


def test_a_section_with_null_scores_draws_with_a_gap_note_for_each(tmp_path: Path) -> None:
    section = scored_section(
        [step_record(0, None, face_detect_rate=0.0), step_record(2, None, face_detect_rate=0.0), step_record(3, None)],
        None,
    )
    folder, names, warnings = report_with(tmp_path, section, rounds=[0, 2], final_step=3)

    assert warnings == []
    assert png_size(folder / "likeness.png") == PLOT_SIZE
    assert [gap_note(record, section["unscored_steps"]) for record in section["steps"]] == [
        "no face found",
        "no face found",
        "no render scored",
    ]


def test_a_step_skipped_for_the_deadline_is_noted_as_not_scored() -> None:
    assert gap_note(step_record(8, None, face_detect_rate=None), [8]) == "not scored (deadline)"


def test_an_unavailable_section_draws_no_plot_and_writes_no_artifact(tmp_path: Path) -> None:
    folder, names, warnings = report_with(
        tmp_path, unavailable_section("the scoring models are not installed"), rounds=[2], final_step=3
    )

    assert warnings == []
    assert "report/likeness.png" not in names and not (folder / "likeness.png").exists()
    assert "report/samples.png" in names


def test_a_report_without_a_likeness_section_has_no_plot(tmp_path: Path) -> None:
    folder, names, warnings = report_with(tmp_path, None, rounds=[2], final_step=3)

    assert warnings == []
    assert sorted(name for name in names if name.endswith(".png")) == [
        "report/dataset.png",
        "report/loss.png",
        "report/samples.png",
    ]


def test_a_section_that_cannot_be_drawn_is_left_out_with_a_warning(tmp_path: Path) -> None:
    folder, names, warnings = report_with(tmp_path, scored_section([], None), rounds=[2], final_step=3)

    assert warnings == ["report: report/likeness.png was not made (ValueError: the likeness section holds no step)"]
    assert "report/likeness.png" not in names and "report/samples.png" in names


def test_the_samples_sheet_frames_the_chosen_steps_row_and_no_other(tmp_path: Path) -> None:
    section = scored_section(
        [step_record(0, 0.0), step_record(2, 0.5, selected=True), step_record(4, 0.6), step_record(5, 0.6)], 2
    )
    folder, _, _ = report_with(tmp_path, section, rounds=[0, 2, 4], final_step=5)

    framed = chosen_ink_rows(folder / "samples.png")
    chosen_band = sample_row_band(row=1, rows=4)  # rows: step 0, step 2 (chosen), step 4, the final step 5
    assert framed and framed <= set(chosen_band)
    assert {chosen_band[0], chosen_band[-1]} <= framed  # the frame's top and bottom edges


def test_the_frame_covers_the_row_from_the_labels_to_the_last_column(tmp_path: Path) -> None:
    section = scored_section([step_record(0, 0.0), step_record(2, 0.5), step_record(3, 0.6, selected=True)], 3)
    folder, _, _ = report_with(tmp_path, section, rounds=[0, 2], final_step=3)

    pixels = np.asarray(Image.open(folder / "samples.png").convert("RGB"))
    top_edge = sample_row_band(row=2, rows=3)[0]
    framed_columns = np.nonzero((pixels[top_edge] == CHOSEN_INK).all(axis=-1))[0]
    width, _, _ = samples_size(3, len(PROMPTS))
    last_tile_right = width - 2 * MARGIN
    assert framed_columns.min() < LABEL_WIDTH and framed_columns.max() > last_tile_right
    assert len(framed_columns) == framed_columns.max() - framed_columns.min() + 1  # one unbroken edge


def test_without_a_chosen_step_the_samples_sheet_has_no_frame(tmp_path: Path) -> None:
    section = scored_section([step_record(0, 0.0), step_record(2, 0.5), step_record(3, 0.6)], None)
    folder, _, _ = report_with(tmp_path, section, rounds=[0, 2], final_step=3)

    assert chosen_ink_rows(folder / "samples.png") == set()


def test_a_long_runs_thinned_rounds_keep_the_chosen_one(tmp_path: Path) -> None:
    write_renders(tmp_path, rounds=list(range(10, 400, 10)), final_step=400)
    history = history_from([], tmp_path)
    assert (20, False) not in history.shown_rounds()

    rounds = history.shown_rounds(keep=20)
    assert len(rounds) == MAX_SHOWN_ROUNDS and (20, False) in rounds
    assert (rounds[0], rounds[-2], rounds[-1]) == ((10, False), (390, False), (400, True))


def test_only_a_scored_sections_step_number_is_a_chosen_step() -> None:
    assert chosen_step(scored_section([step_record(2, 0.5, selected=True)], 2)) == 2
    assert chosen_step(scored_section([step_record(2, 0.5)], None)) is None
    assert chosen_step({**unavailable_section("no models"), "selected_step": 2}) is None
    assert chosen_step({**scored_section([], None), "selected_step": True}) is None
