"""The dataset check: duplicates, blur, size, aspect ratio and faces, named by the file as uploaded; warn or
refuse (`dataset_checks`), before the trainer starts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fluxbooth.dataset import PreparedDataset, prepare_dataset
from fluxbooth.dataset.checks import DatasetChecks, check_dataset, check_prepared, enforce
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.job.run import run_job
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import TINY_MODEL_NAME, DatasetLimits, WorkerSettings
from tests.support.factories import make_zip, to_base64
from tests.support.photos import (
    BLURRED,
    DUPLICATED,
    encoded,
    flawed_dataset_members,
    portrait,
    textured_photo,
    two_people,
)

FLAWED = {*DUPLICATED, BLURRED}
SQUARE_256 = (256, 256)


def request_fields(members: list[tuple[str, bytes]], **fields: Any) -> dict[str, Any]:
    return {
        "model_name": "sks-person",
        "dataset": to_base64(make_zip(members)),
        "instance_prompt": "a photo of sks person",
        "resolution": 256,
        **fields,
    }


def prepared(tmp_path: Path, members: list[tuple[str, bytes]], **fields: Any) -> PreparedDataset:
    return prepare_dataset(
        dataset_spec(parse_request(request_fields(members, **fields))), tmp_path / "job", DatasetLimits()
    )


def checked(dataset: PreparedDataset, shape: tuple[int, int] = SQUARE_256, mode: Any = "warn") -> DatasetChecks:
    return check_prepared(dataset, lambda width, height: shape, mode)


def named(checks: DatasetChecks, check: str) -> list[tuple[str, ...]]:
    return [finding.files for finding in checks.findings if finding.check == check]


def files_of(tmp_path: Path, images: dict[str, Image.Image]) -> list[tuple[str, Path]]:
    files = []
    for name, image in images.items():
        path = tmp_path / f"{len(files)}.png"
        image.save(path)
        files.append((name, path))
    return files


@pytest.fixture(scope="module")
def flawed(tmp_path_factory: pytest.TempPathFactory) -> DatasetChecks:
    return checked(prepared(tmp_path_factory.mktemp("flawed"), flawed_dataset_members()))


def test_a_byte_identical_copy_is_named_with_its_original_as_identical(flawed: DatasetChecks) -> None:
    # Files are named in the dataset's order: the archive's members sorted by name.
    assert named(flawed, "duplicate") == [("photo0 copy.jpg", "photo0.jpg")]


def test_a_copy_re_encoded_at_another_jpeg_quality_is_named_as_a_near_duplicate(flawed: DatasetChecks) -> None:
    assert named(flawed, "near_duplicate") == [tuple(sorted(DUPLICATED))]


def test_a_blurred_photo_is_named_and_no_sharp_one_is(flawed: DatasetChecks) -> None:
    assert named(flawed, "blurry") == [(BLURRED,)]


def test_the_warnings_name_exactly_the_duplicated_and_the_blurred_files(flawed: DatasetChecks) -> None:
    text = "\n".join(flawed.warnings())
    named_files = {name for name in flawed.faces_by_file() if name in text}
    assert named_files == FLAWED
    assert {finding.check for finding in flawed.findings} == {"duplicate", "near_duplicate", "blurry"}


def test_the_result_reports_each_finding_and_every_images_measures(flawed: DatasetChecks) -> None:
    report = flawed.to_dict()
    assert (report["mode"], report["images"]) == ("warn", 7)
    assert [(finding["check"], finding["files"]) for finding in report["findings"]] == [
        ("duplicate", ["photo0 copy.jpg", "photo0.jpg"]),
        ("near_duplicate", sorted(DUPLICATED)),
        ("blurry", [BLURRED]),
    ]
    assert set(report["faces"]) == set(report["sharpness"]) == {*FLAWED, "photo1.jpg", "photo2.jpg", "photo3.jpg"}


def test_the_same_flaws_are_found_at_the_tiny_models_training_size(tmp_path: Path) -> None:
    checks = checked(prepared(tmp_path, flawed_dataset_members(), resolution=64), shape=(64, 64))
    assert {name for finding in checks.findings for name in finding.files} == FLAWED


def test_distinct_sharp_photos_pass_every_check(tmp_path: Path) -> None:
    members = [(f"scene{seed}.png", encoded(textured_photo(seed), "PNG")) for seed in range(6)]
    assert checked(prepared(tmp_path, members)).findings == ()


def test_an_image_smaller_than_its_training_shape_is_too_small(tmp_path: Path) -> None:
    files = files_of(
        tmp_path,
        {f"scene{seed}.png": textured_photo(seed) for seed in range(3)} | {"small.png": textured_photo(9, (200, 180))},
    )
    checks = check_dataset(files, lambda width, height: SQUARE_256, "warn")
    assert [finding.message for finding in checks.findings] == ["small.png: 200x180, upscaled 1.4x to cover 256x256"]


def test_a_panorama_is_flagged_for_its_aspect_ratio(tmp_path: Path) -> None:
    files = files_of(
        tmp_path,
        {f"scene{seed}.png": textured_photo(seed) for seed in range(3)} | {"wide.png": textured_photo(9, (780, 256))},
    )
    checks = check_dataset(files, lambda width, height: SQUARE_256, "warn")
    assert [finding.message for finding in checks.findings] == [
        "wide.png: 3.0:1 (780x256), trained at 256x256 from 33 % of it"
    ]


@pytest.fixture(scope="module")
def portraits(tmp_path_factory: pytest.TempPathFactory) -> DatasetChecks:
    images = {f"portrait{index}.png": portrait(index) for index in range(3)}
    images |= {"scenery.png": textured_photo(3), "couple.png": two_people()}
    files = files_of(tmp_path_factory.mktemp("portraits"), images)
    return check_dataset(files, lambda width, height: (width, height), "warn")


def test_faces_are_counted_in_every_image(portraits: DatasetChecks) -> None:
    assert portraits.faces_by_file() == {
        "portrait0.png": 1,
        "portrait1.png": 1,
        "portrait2.png": 1,
        "scenery.png": 0,
        "couple.png": 2,
    }


def test_in_a_set_of_portraits_a_photo_without_a_face_and_one_with_two_are_flagged(portraits: DatasetChecks) -> None:
    assert [(finding.check, finding.files) for finding in portraits.findings] == [
        ("no_face", ("scenery.png",)),
        ("several_faces", ("couple.png",)),
    ]


def test_a_set_where_most_images_show_no_face_gets_no_face_flags(tmp_path: Path) -> None:
    images = {f"scene{seed}.png": textured_photo(seed) for seed in range(3)} | {"portrait.png": portrait(0)}
    checks = check_dataset(files_of(tmp_path, images), lambda width, height: (width, height), "warn")
    assert checks.faces_by_file() == {"scene0.png": 0, "scene1.png": 0, "scene2.png": 0, "portrait.png": 1}
    assert checks.findings == ()


def test_strict_refuses_naming_every_flagged_file_and_its_reason(flawed: DatasetChecks) -> None:
    from dataclasses import replace

    with pytest.raises(FluxboothError) as caught:
        enforce(replace(flawed, mode="strict"))
    assert caught.value.code is ErrorCode.INVALID_DATASET
    message = caught.value.message
    assert message.startswith("dataset: dataset_checks is strict and 4 file(s) failed the dataset check: ")
    assert message.endswith('. Remove or replace them, or set dataset_checks to "warn"')
    for finding in flawed.findings:
        assert finding.message in message
    assert [item["files"] for item in caught.value.details["findings"]] == [
        list(finding.files) for finding in flawed.findings
    ]


def test_warn_lets_the_same_findings_through(flawed: DatasetChecks) -> None:
    enforce(flawed)


def test_dataset_checks_is_warn_unless_the_request_says_strict() -> None:
    base = request_fields(flawed_dataset_members()[:1])
    assert parse_request(base).dataset_checks == "warn"
    assert parse_request({**base, "dataset_checks": "strict"}).dataset_checks == "strict"


def test_an_unknown_dataset_checks_mode_is_invalid_input_naming_the_field() -> None:
    with pytest.raises(FluxboothError) as caught:
        parse_request({**request_fields(flawed_dataset_members()[:1]), "dataset_checks": "off"})
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert "dataset_checks" in caught.value.message


def test_a_strict_job_is_refused_before_the_trainer_starts(worker_env: dict[str, str]) -> None:
    progress: list[dict[str, Any]] = []
    job_input = request_fields(
        flawed_dataset_members(), base_model=TINY_MODEL_NAME, resolution=64, steps=2, dataset_checks="strict"
    )
    result = asyncio.run(
        run_job(job_input, job_id="strict", settings=WorkerSettings.from_environ(worker_env), progress=progress.append)
    )

    assert result["error"]["code"] == "invalid_dataset", result
    for name in FLAWED:
        assert name in result["error"]["message"]
    stages = [update["stage"] for update in progress]
    assert "checks" in stages and "launch" not in stages


# ---- bounded messages (issue 29, item 8) -----------------------------------------------------------------


@pytest.fixture(scope="module")
def long_named_duplicates(tmp_path_factory: pytest.TempPathFactory) -> DatasetChecks:
    photo = textured_photo(7)
    names = [f"{index:02d}" + "n" * 4000 + ".jpg" for index in range(12)]
    files = files_of(tmp_path_factory.mktemp("long-names"), dict.fromkeys(names, photo))
    return check_dataset(files, lambda width, height: SQUARE_256, "strict")


def test_twelve_long_named_duplicates_refused_under_strict_stay_under_8_kb(
    long_named_duplicates: DatasetChecks,
) -> None:
    import json

    with pytest.raises(FluxboothError) as caught:
        enforce(long_named_duplicates)
    error = caught.value
    assert len(json.dumps(error.to_result(), ensure_ascii=False)) < 8 * 1024
    assert error.message.startswith("dataset: dataset_checks is strict and 12 file(s) failed the dataset check: 00nnn")
    assert ", and 4 more: identical pixels (the same photo more than once: keep one)." in error.message
    assert error.details["findings"][0]["file_count"] == 12


def test_twelve_long_named_duplicates_warned_about_stay_under_8_kb(long_named_duplicates: DatasetChecks) -> None:
    from dataclasses import replace

    warnings = replace(long_named_duplicates, mode="warn").warnings()
    assert sum(len(line) for line in warnings) < 8 * 1024
    assert warnings[0].endswith(", and 4 more: identical pixels")


def test_a_long_name_is_shortened_in_its_middle_keeping_its_start_and_extension(
    long_named_duplicates: DatasetChecks,
) -> None:
    shown = long_named_duplicates.findings[0].shown_files[0]
    assert len(shown) == 120 and shown.startswith("00nnn") and shown.endswith("nnn.jpg") and "…" in shown


def test_twelve_uploaded_duplicates_with_4000_character_names_are_refused_under_8_kb(tmp_path: Path) -> None:
    import json

    photo = encoded(textured_photo(3), "JPEG")
    members = [(f"{index:02d}" + "n" * 4000 + ".jpg", photo) for index in range(12)]
    dataset = prepared(tmp_path, members, dataset_checks="strict")
    with pytest.raises(FluxboothError) as caught:
        enforce(checked(dataset, mode="strict"))
    assert caught.value.code is ErrorCode.INVALID_DATASET
    assert len(json.dumps(caught.value.to_result(), ensure_ascii=False)) < 8 * 1024
    assert sum(len(line) for line in checked(dataset).warnings()) < 8 * 1024
