"""The scoring process end to end: `python -m fluxbooth.likeness --input scoring-input.json --output likeness.json`
on a folder laid out as the trainer writes it (validation.json and PNGs under step-NNNNNN/), run as the job runs
it, in a process of its own. Faces use dlib's real weights on public-domain portraits (tests/support/likeness_fixtures.py;
augmented views are not independent photos); DINOv2 and SigLIP are tiny random models (wiring only) or absent."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fluxbooth.contract.budgets import MAX_SCORED_PHOTOS
from fluxbooth.contract.scoring import PROXY_NOTE, ScoringInput
from fluxbooth.likeness.scoring import UNSCORED_REASON, evenly_spread
from tests.conftest import REPO_ROOT
from tests.support.likeness_fixtures import (
    astronaut,
    cat,
    coffee,
    grace_hopper,
    offline_environ,
    save_all,
    tiny_dino,
    tiny_siglip,
    views,
    write_validation,
)

PROMPTS = ("a photo of sks woman", "sks woman on a beach")
FIDELITY_PROMPTS = ("a photo of woman", "woman on a beach")


def run_scoring_process(tmp_path: Path, scoring_input: ScoringInput) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The scoring process as the job runs it, on `scoring_input`; (the finished process, its output path)."""
    input_path, output_path = tmp_path / "scoring-input.json", tmp_path / "likeness.json"
    scoring_input.write(input_path)
    environment = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.likeness", "--input", str(input_path), "--output", str(output_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
        cwd=REPO_ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    return completed, output_path


def run_scoring(tmp_path: Path, scoring_input: ScoringInput) -> dict:
    _, output_path = run_scoring_process(tmp_path, scoring_input)
    return json.loads(output_path.read_text())


def person_job(tmp_path: Path, renders_by_step: dict, final_step: int, **overrides: object) -> ScoringInput:
    save_all(
        list(views(astronaut(), ("original", "crop_and_scale", "colour_shift", "new_background")).values()),
        tmp_path / "photos",
    )
    write_validation(tmp_path / "validation", renders_by_step, PROMPTS)
    values = {
        "photos_dir": str(tmp_path / "photos"),
        "validation_dir": str(tmp_path / "validation"),
        "subject_type": "auto",
        "fidelity_prompts": FIDELITY_PROMPTS,
        "keep_best_step": True,
        "final_step": final_step,
        "environ": offline_environ(tmp_path),
        **overrides,
    }
    return ScoringInput(**values)


def step(section: dict, number: int) -> dict:
    return next(item for item in section["steps"] if item["step"] == number)


def portrait_steps() -> dict:
    held_out = views(astronaut(), ("rotation", "jpeg", "flip"))
    return {
        0: [grace_hopper(), views(grace_hopper(), ("flip",))["flip"]],  # the base model: someone else
        100: [cat(), coffee()],  # no face at all
        200: [held_out["rotation"], held_out["jpeg"]],
        300: [held_out["flip"], astronaut()],  # one of two renders is a training photo: a copy
    }


def test_a_person_job_is_scored_at_every_step_and_the_earliest_good_step_chosen(tmp_path: Path) -> None:
    section = run_scoring(tmp_path, person_job(tmp_path, portrait_steps(), final_step=300))
    assert section["status"] == "scored" and section["note"] == PROXY_NOTE
    assert (section["subject_type"], section["subject_type_source"]) == (
        "person",
        "auto: 4 of 4 photos hold exactly one face",
    )
    assert [item["step"] for item in section["steps"]] == [0, 100, 200, 300]
    assert step(section, 0)["likeness"] == 0.0 and step(section, 0)["failed_guards"] == ["base model"]
    assert (step(section, 100)["likeness"], step(section, 100)["face_detect_rate"]) == (None, 0.0)
    assert step(section, 100)["failed_guards"] == ["unscored"]
    assert step(section, 200)["likeness"] > 0.5 and step(section, 200)["face_match_rate"] == 1.0
    assert step(section, 300)["copies"] == 1 and step(section, 300)["failed_guards"] == ["copies"]
    assert section["selected_step"] == 200 and step(section, 200)["selected"]
    assert section["selection"].startswith("Chosen: step 200 is the earliest step")
    assert section["calibration"]["zero_source"] == "the base model's renders at step 0"
    assert (section["unscored_steps"], section["unscored_reason"]) == ([], None)


def test_face_descriptors_are_never_written_or_logged_only_the_section_leaves_the_process(tmp_path: Path) -> None:
    scoring_input = person_job(tmp_path, portrait_steps(), final_step=300)
    before = {path for path in tmp_path.rglob("*")} | {tmp_path / "scoring-input.json"}

    completed, output_path = run_scoring_process(tmp_path, scoring_input)

    assert {path for path in tmp_path.rglob("*")} - before == {output_path}
    # A 128-number descriptor, printed or logged, would show as a run of numbers; the section holds a handful each.
    longest_run = max(
        (len(re.findall(r"-?\d+\.\d+", line)) for line in (completed.stdout + completed.stderr).splitlines()), default=0
    )
    assert longest_run < 8
    section_numbers = [value for value in re.findall(r"-?\d+\.\d+", output_path.read_text())]
    assert len(section_numbers) < 128


def test_without_dinov2_and_siglip_a_person_job_reports_them_unavailable_and_their_numbers_null(tmp_path: Path) -> None:
    section = run_scoring(tmp_path, person_job(tmp_path, portrait_steps(), final_step=300))
    models = {model["role"]: model for model in section["models"]}
    assert (models["likeness"]["status"], models["variety"]["status"], models["prompt_fidelity"]["status"]) == (
        "used",
        "unavailable",
        "unavailable",
    )
    assert models["prompt_fidelity"]["reason"].endswith("bake it into the image or set FLUXBOOTH_LIKENESS_SIGLIP")
    assert all(item["prompt_fidelity"] is None and item["variety"] is None for item in section["steps"])


def test_past_the_deadline_only_step_0_and_the_final_step_are_scored_and_the_rest_listed(tmp_path: Path) -> None:
    job = person_job(tmp_path, portrait_steps(), final_step=300, stop_at_unix_seconds=time.time() - 1)
    section = run_scoring(tmp_path, job)
    assert section["unscored_steps"] == [100, 200] and section["unscored_reason"] == UNSCORED_REASON
    assert step(section, 200)["failed_guards"] == ["unscored"] and step(section, 200)["likeness"] is None
    assert step(section, 300)["likeness"] is not None and section["selected_step"] is None
    assert section["selection"] == (
        "No step was chosen, the final weights stay main: every validation step failed a guard: "
        "unscored (steps 100, 200); copies (step 300)"
    )


def test_keep_best_step_off_selects_nothing_and_says_which_step_the_rule_would_pick(tmp_path: Path) -> None:
    section = run_scoring(tmp_path, person_job(tmp_path, portrait_steps(), final_step=300, keep_best_step=False))
    assert section["selected_step"] is None and not any(item["selected"] for item in section["steps"])
    assert section["selection"].startswith(
        "keep_best_step is off, so the final weights stay main; by the rule, step 200"
    )


def test_an_object_job_without_dinov2_writes_an_unavailable_section_and_exits_0(tmp_path: Path) -> None:
    section = run_scoring(tmp_path, person_job(tmp_path, portrait_steps(), final_step=300, subject_type="object"))
    assert section["status"] == "unavailable" and section["steps"] == [] and section["selected_step"] is None
    assert section["reason"].startswith("objects are scored by DINOv2, which is unavailable: facebook/dinov2-small")


def test_a_run_without_validation_json_writes_an_unavailable_section(tmp_path: Path) -> None:
    job = person_job(tmp_path, portrait_steps(), final_step=300)
    (tmp_path / "validation" / "validation.json").unlink()
    section = run_scoring(tmp_path, job)
    assert section["status"] == "unavailable"
    assert (
        section["reason"]
        == f"{tmp_path / 'validation' / 'validation.json'} is missing: the run rendered no validation prompts"
    )


def test_an_object_job_with_tiny_dinov2_and_siglip_reports_every_number(tmp_path: Path) -> None:
    """Wiring only: tiny random models, so the values mean nothing; every number is there and every model used."""
    environ = {
        **offline_environ(tmp_path),
        "FLUXBOOTH_LIKENESS_DINO": str(tiny_dino(tmp_path / "dino")),
        "FLUXBOOTH_LIKENESS_SIGLIP": str(tiny_siglip(tmp_path / "siglip")),
    }
    tiny_renders = {number: [image.resize((64, 64)) for image in images] for number, images in portrait_steps().items()}
    section = run_scoring(
        tmp_path, person_job(tmp_path, tiny_renders, final_step=300, subject_type="object", environ=environ)
    )
    assert section["status"] == "scored" and section["subject_type"] == "object"
    assert [model["status"] for model in section["models"]] == ["used", "used"]
    for item in section["steps"]:
        assert item["likeness"] is not None and item["prompt_fidelity"] is not None and item["variety"] is not None
        assert item["face_detect_rate"] is None and item["face_match_rate"] is None
    assert step(section, 0)["prompt_fidelity_change"] == 0.0


@pytest.mark.parametrize("content", ["not json", '{"photos_dir": "/x"}'])
def test_an_unreadable_scoring_input_writes_an_unavailable_section(tmp_path: Path, content: str) -> None:
    (tmp_path / "scoring-input.json").write_text(content)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fluxbooth.likeness",
            "--input",
            str(tmp_path / "scoring-input.json"),
            "--output",
            str(tmp_path / "likeness.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)},
        cwd=REPO_ROOT,
    )
    section = json.loads((tmp_path / "likeness.json").read_text())
    assert completed.returncode == 0 and section["status"] == "unavailable"
    assert section["reason"].startswith("scoring failed (")


def test_a_large_dataset_is_scored_from_at_most_max_scored_photos_spread_evenly_over_it() -> None:
    files = [Path(f"photo{index:04d}.png") for index in range(1000)]

    chosen = evenly_spread(files, MAX_SCORED_PHOTOS)

    assert len(chosen) == MAX_SCORED_PHOTOS and chosen[0] == files[0] and len(set(chosen)) == MAX_SCORED_PHOTOS
    assert chosen[-1].name >= "photo0950.png"
    assert evenly_spread(files[:5], MAX_SCORED_PHOTOS) == files[:5]
