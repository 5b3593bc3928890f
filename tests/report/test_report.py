"""The training report from a run's events, validation renders and dataset: each file valid of its type,
small at any size, and a part that cannot be drawn left out with a warning (the job never fails for it).

Fast: the events and renders are built here, as the trainer writes them (tests/report/test_report_job.py runs
the real trainer)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from PIL import Image

from fluxbooth.contract.budgets import MAX_SHEET_IMAGES, MAX_SHOWN_ROUNDS
from fluxbooth.contract.events import CheckpointEvent, StageEvent, TrainerEvent
from fluxbooth.contract.layout import VALIDATION_FOLDER
from fluxbooth.report import ReportInputs, SheetImage, make_report, report_artifacts
from fluxbooth.report.history import history_from, smoothed
from fluxbooth.report.sheets import LABEL_WIDTH, MARGIN, SAMPLES_HEADER, TITLE_SIZE, dataset_size, samples_size
from fluxbooth.report.tensorboard import TENSORBOARD_IMAGE_SIDE
from tests.support.photos import png_size, textured_photo
from tests.support.report_inputs import PROMPTS, sheet_of, step_events, write_renders

MAX_PNG_BYTES = 4 * 1024 * 1024


def report_of(
    tmp_path: Path, events: list[TrainerEvent], images: list[SheetImage]
) -> tuple[Path, list[str], list[str]]:
    output_dir = tmp_path / "output"
    output_dir.mkdir(exist_ok=True)
    report = make_report(ReportInputs("sks-dog", events, output_dir, images, lambda width, height: (64, 64)))
    names = [artifact.name for artifact in report_artifacts(report, output_dir)]
    return output_dir / "report", names, list(report.warnings)


@pytest.fixture
def validated_run(tmp_path: Path) -> tuple[Path, list[str], list[str]]:
    write_renders(tmp_path / "output", rounds=[2, 4], final_step=5)
    events = [*step_events(5), CheckpointEvent(step=3, path="checkpoint-3"), StageEvent("validate", {"step": 2})]
    return report_of(tmp_path, events, sheet_of(tmp_path / "instance", 5))


def test_every_part_is_an_artifact_under_report(validated_run: tuple[Path, list[str], list[str]]) -> None:
    _, names, warnings = validated_run
    (event_file,) = [name for name in names if name.startswith("report/tensorboard/")]
    assert sorted(set(names) - {event_file}) == [
        "report/captions.json",
        "report/dataset.png",
        "report/history.json",
        "report/loss.png",
        "report/samples.png",
    ]
    assert Path(event_file).name.startswith("events.out.tfevents.") and Path(event_file).name.endswith(".fluxbooth")
    assert warnings == []


def test_history_json_holds_every_steps_loss_and_learning_rate_and_the_marks(
    validated_run: tuple[Path, list[str], list[str]],
) -> None:
    history = json.loads((validated_run[0] / "history.json").read_text())
    assert [(entry["step"], entry["loss"], entry["lr"]) for entry in history["steps"]] == [
        (step, 1.0 / step, 1e-4 * min(1.0, step / 3)) for step in range(1, 6)
    ]
    assert (history["checkpoints"], history["validation_steps"], history["validation_prompts"]) == (
        [3],
        [2, 4, 5],
        list(PROMPTS),
    )


def test_samples_png_has_a_row_per_validation_round_and_the_final_one(
    validated_run: tuple[Path, list[str], list[str]],
) -> None:
    width, height, _ = samples_size(rows=3, columns=len(PROMPTS))
    assert png_size(validated_run[0] / "samples.png") == (width, height)


def test_a_validation_prompt_given_twice_gets_a_column_per_position_and_no_render_is_lost(tmp_path: Path) -> None:
    prompts = ("a photo of sks dog", "a sks dog in the snow", "a photo of sks dog")
    write_renders(tmp_path / "output", rounds=[2], final_step=3, prompts=prompts)
    folder, _, warnings = report_of(tmp_path, step_events(3), sheet_of(tmp_path / "instance", 2))
    assert warnings == []
    assert json.loads((folder / "history.json").read_text())["validation_prompts"] == list(prompts)
    width, height, tile = samples_size(rows=2, columns=3)
    assert png_size(folder / "samples.png") == (width, height)
    left, top = LABEL_WIDTH + 2 * (tile + MARGIN), TITLE_SIZE + 2 * MARGIN + SAMPLES_HEADER
    with Image.open(folder / "samples.png") as sheet:
        cells = [sheet.convert("L").crop((left, y, left + tile, y + tile)) for y in (top, top + tile + MARGIN)]
    # Each row's third cell holds its render, not the blank white of a missing one.
    assert [cell.getextrema()[0] < 200 for cell in cells] == [True, True]


def test_loss_and_dataset_pngs_are_images(validated_run: tuple[Path, list[str], list[str]]) -> None:
    assert png_size(validated_run[0] / "loss.png") == (990, 495)
    width, height, _, _ = dataset_size(5)
    assert png_size(validated_run[0] / "dataset.png") == (width, height)


def test_the_event_file_reads_back_in_tensorboard(validated_run: tuple[Path, list[str], list[str]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(validated_run[0] / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    assert [(event.step, event.value) for event in accumulator.Scalars("train/loss")] == [
        (step, pytest.approx(1.0 / step)) for step in range(1, 6)
    ]
    assert [event.step for event in accumulator.Scalars("train/learning_rate")] == [1, 2, 3, 4, 5]
    assert [event.step for event in accumulator.Images("validation/prompt_01")] == [2, 4]
    (final,) = accumulator.Images("validation_final/prompt_01")
    assert (final.step, final.width, final.height) == (5, 64, 64)
    with Image.open(io.BytesIO(final.encoded_image_string)) as image:
        assert (image.format, image.size) == ("JPEG", (64, 64))


def test_tensorboard_holds_the_shown_rounds_downscaled(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_renders(tmp_path / "output", rounds=list(range(10, 200, 10)), final_step=200, side=1024)
    folder, _, _ = report_of(tmp_path, step_events(200), sheet_of(tmp_path / "instance", 1))
    accumulator = EventAccumulator(str(folder / "tensorboard"), size_guidance={"images": 0})
    accumulator.Reload()
    during = accumulator.Images("validation/prompt_00")
    assert len(during) == MAX_SHOWN_ROUNDS - 1
    assert {(image.width, image.height) for image in during} == {(TENSORBOARD_IMAGE_SIDE, TENSORBOARD_IMAGE_SIDE)}


def test_without_validation_prompts_there_is_no_samples_grid_and_no_warning(tmp_path: Path) -> None:
    folder, names, warnings = report_of(tmp_path, step_events(4), sheet_of(tmp_path / "instance", 3))
    assert "report/samples.png" not in names and warnings == []
    assert not (folder / "samples.png").exists()


def test_a_part_that_cannot_be_drawn_is_left_out_with_a_warning_and_the_rest_is_made(tmp_path: Path) -> None:
    write_renders(tmp_path / "output", rounds=[2], final_step=3)
    (tmp_path / "output" / VALIDATION_FOLDER / "validation_00.png").write_bytes(b"not a png")
    folder, names, warnings = report_of(tmp_path, step_events(3), sheet_of(tmp_path / "instance", 2))

    assert [warning.split(" was not made")[0] for warning in warnings] == [
        "report: report/samples.png",
        "report: report/tensorboard",
    ]
    reason = (
        "(ValueError: image 'validation/validation_00.png' is not a readable JPEG/PNG/WEBP/BMP/GIF/TIFF/HEIF/AVIF file; "
        "re-export it as JPEG or PNG)"
    )
    assert [warning.split(" was not made ")[1] for warning in warnings] == [reason, reason]
    assert sorted(names) == ["report/captions.json", "report/dataset.png", "report/history.json", "report/loss.png"]
    assert sorted(path.name for path in folder.iterdir()) == [
        "captions.json",
        "dataset.png",
        "history.json",
        "loss.png",
    ]


def test_a_run_without_steps_gets_no_loss_curve_and_says_why(tmp_path: Path) -> None:
    _, names, warnings = report_of(tmp_path, [], sheet_of(tmp_path / "instance", 1))
    assert warnings == ["report: report/loss.png was not made (ValueError: the trainer reported no optimizer step)"]
    assert "report/loss.png" not in names


def test_the_pngs_stay_small_for_a_large_run_of_incompressible_images(tmp_path: Path) -> None:
    write_renders(tmp_path / "output", rounds=list(range(50, 2000, 50)), final_step=2000, side=512, noise=True)
    folder, _, warnings = report_of(
        tmp_path, step_events(2000), sheet_of(tmp_path / "instance", 120, side=512, noise=True)
    )

    assert warnings == []
    for name in ("samples.png", "dataset.png", "loss.png"):
        assert (folder / name).stat().st_size < MAX_PNG_BYTES, name
    assert png_size(folder / "samples.png") == samples_size(MAX_SHOWN_ROUNDS, len(PROMPTS))[:2]
    assert png_size(folder / "dataset.png") == dataset_size(MAX_SHEET_IMAGES)[:2]


def test_a_long_runs_rounds_are_thinned_keeping_the_first_and_last_and_the_final_render(tmp_path: Path) -> None:
    write_renders(tmp_path, rounds=list(range(10, 400, 10)), final_step=400)
    rounds = history_from([], tmp_path).shown_rounds()
    assert len(rounds) == MAX_SHOWN_ROUNDS
    assert (rounds[0], rounds[-2], rounds[-1]) == ((10, False), (390, False), (400, True))
    assert [step for step, _ in rounds] == sorted(step for step, _ in rounds)


def test_a_resumed_run_reports_the_steps_it_trained(tmp_path: Path) -> None:
    history = history_from(step_events(6, first=4), tmp_path)
    assert [record.step for record in history.steps] == [4, 5, 6]


def test_the_smoothed_line_follows_a_long_run_and_leaves_a_short_one_as_it_is() -> None:
    assert smoothed([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    noisy = [1.0 + (0.5 if step % 2 else -0.5) for step in range(1000)]
    tail = smoothed(noisy)[500:]
    assert all(math.isclose(value, 1.0, abs_tol=0.05) for value in tail)


def test_the_contact_sheet_shows_each_caption_as_trained_with_the_trigger_word(tmp_path: Path) -> None:
    from fluxbooth.dataset import prepare_dataset
    from fluxbooth.report import sheet_images
    from fluxbooth.request.dataset_spec import dataset_spec
    from fluxbooth.request.model import parse_request
    from fluxbooth.settings import DatasetLimits
    from tests.support.factories import make_zip, to_base64
    from tests.support.photos import encoded

    members = [
        ("bench.png", encoded(textured_photo(0), "PNG")),
        ("bench.txt", b"a photo of [trigger] on a bench"),
        ("lawn.png", encoded(textured_photo(1), "PNG")),
        ("pond.png", encoded(textured_photo(2), "PNG")),
    ]
    request = parse_request(
        {
            "model_name": "sks-dog",
            "dataset": to_base64(make_zip(members)),
            "instance_prompt": "a photo of a dog",
            "trigger_word": "sks",
            "resolution": 64,
        }
    )
    dataset = prepare_dataset(dataset_spec(request), tmp_path / "job", DatasetLimits())
    images = sheet_images(dataset, request.instance_prompt, {"lawn.png": ["blurry"]})
    assert [(image.name, image.caption, image.flags) for image in images] == [
        ("bench.png", "a photo of sks on a bench", ()),
        ("lawn.png", "sks a photo of a dog", ("blurry",)),
        ("pond.png", "sks a photo of a dog", ()),
    ]
