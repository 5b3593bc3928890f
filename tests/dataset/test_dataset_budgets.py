"""Work budgets per job: what an upload can make the worker decompress, decode and write is bounded per
byte uploaded, each budget is checked before the work it bounds, and a full disk is `does_not_fit`.

The adversarial archives are built here, byte by byte where zipfile would refuse to write them, after the
attacks measured against the worker: a central directory listing the same compressed data many times
(1.2 MB uploaded wrote 4.2 GB), one large image decoded 40 times, and tall, thin images stored as
uncompressed PNGs at their own size (a dozen in a 1.6 MB zip wrote 1.8 GB).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import random
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from fluxbooth.dataset import PreparedDataset, normalise_image, prepare_dataset
from fluxbooth.dataset.images import stored_bytes_bound
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import format_bytes
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import DatasetLimits, WorkerSettings
from tests.conftest import mounted_tmpfs
from tests.support.factories import dataset_members, make_image, make_oversized_png, make_zip, to_base64
from tests.support.hostile_zips import (
    MiB,
    central_entry,
    deflated,
    end_of_directory,
    flat_png,
    local_header,
    repeated_deflate,
    sparse_block,
    zip_listing_one_member_many_times,
    zip_with_overlapping_members,
)

LIMITS = DatasetLimits()


def prepare(
    job_dir: Path,
    archive: bytes,
    limits: DatasetLimits = LIMITS,
    on_image: Callable[[int, int], None] | None = None,
    **fields: Any,
) -> PreparedDataset:
    raw = {"model_name": "sks-dog", "dataset": to_base64(archive), "instance_prompt": "a photo of sks dog"}
    return prepare_dataset(dataset_spec(parse_request({**raw, **fields})), job_dir, limits, on_image=on_image)


def refusal(job_dir: Path, archive: bytes, limits: DatasetLimits = LIMITS, **fields: Any) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        prepare(job_dir, archive, limits, **fields)
    return caught.value


# ------------------------------------------------------------------------------------ measuring


@dataclass(frozen=True)
class Work:
    outcome: PreparedDataset | FluxboothError
    bytes_written: int  # every byte this thread handed to write(), whatever the filesystem
    cpu_seconds: float  # this thread's CPU time


def _bytes_written_by_this_thread() -> int:
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("/proc/thread-self/io has no wchar line")


def measured(action: Callable[[], PreparedDataset]) -> Work:
    written_before, cpu_before = _bytes_written_by_this_thread(), time.thread_time()
    outcome: PreparedDataset | FluxboothError
    try:
        outcome = action()
    except FluxboothError as error:
        outcome = error
    return Work(outcome, _bytes_written_by_this_thread() - written_before, time.thread_time() - cpu_before)


def stored_bytes(prepared: PreparedDataset) -> int:
    """Disk the stored images take (hard links to one file counted once)."""
    inodes = {path.stat().st_ino: path.stat().st_size for path in prepared.instance_dir.rglob("*.png")}
    return sum(inodes.values())


# The refused attacks stop on headers: a few milliseconds of CPU. The bound is loose on purpose (a busy
# two-core CI machine), and still far below the 25 s the repeated-image attack used to cost.
REFUSAL_CPU_SECONDS = 2.0


# ------------------------------------------------------------------------------------ the archive


def test_the_repeated_directory_attack_is_refused_having_written_only_the_upload(tmp_path: Path) -> None:
    # 1.2 MB of deflate data expanding to 223 MiB, listed 19 times: 4.2 GB, under the 4 GiB total cap.
    member = repeated_deflate(sparse_block(MiB, 700, seed=1), repeats=223)
    archive = zip_listing_one_member_many_times(member, ["photo.png"] * 19)

    work = measured(lambda: prepare(tmp_path / "job", archive))

    assert 1.1e6 < len(archive) < 1.3e6 and 19 * member.file_size > 4.1e9
    assert isinstance(work.outcome, FluxboothError)
    assert work.outcome.code is ErrorCode.INVALID_DATASET
    assert work.outcome.message == (
        "dataset: members 'photo.png' and 'photo.png' point at the same compressed data, a zip-bomb trick "
        "that repeats the work; re-create the zip with a standard tool"
    )
    assert work.bytes_written <= len(archive) + 64 * 1024
    assert work.cpu_seconds < REFUSAL_CPU_SECONDS
    assert not (tmp_path / "job" / "raw").exists()


def test_members_whose_data_overlaps_are_refused(tmp_path: Path) -> None:
    archive = zip_with_overlapping_members(deflated(make_image("PNG")), ("a.png", "b.png", "c.png"))

    error = refusal(tmp_path / "job", archive)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        "dataset: members 'a.png' and 'b.png' point at overlapping compressed data, a zip-bomb trick that "
        "repeats the work; re-create the zip with a standard tool"
    )


def test_a_member_running_into_the_central_directory_is_refused(tmp_path: Path) -> None:
    member = deflated(make_image("PNG"))
    body = local_header(b"a.png", member) + member.compressed
    directory = central_entry(b"a.png", member, 0, compress_size=len(member.compressed) + 10)
    archive = body + directory + end_of_directory(1, directory, len(body))

    error = refusal(tmp_path / "job", archive)

    assert error.message == (
        "dataset: member 'a.png' runs into the archive's directory; the zip is damaged, re-create it"
    )


def test_an_archive_expanding_past_the_ratio_cap_in_total_is_refused_before_extracting(tmp_path: Path) -> None:
    # 40 distinct members of 2 MiB, each deflating about 186x: every one passes the per-member 200x check,
    # together they expand 80 MiB from well under 1 MB.
    members = [(f"photo{index}.png", sparse_block(2 * MiB, 700, seed=index)) for index in range(40)]
    archive = make_zip(members)
    ratio = 80 * MiB / len(archive)

    error = refusal(tmp_path / "job", archive)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        f"dataset: the archive's {format_bytes(len(archive))} expand to 80.0 MiB, {ratio:,.0f}x, over the 100x cap "
        "(FLUXBOOTH_MAX_ARCHIVE_EXPANSION_RATIO); images do not compress like that, so re-create the zip from "
        "the photos themselves"
    )
    assert not (tmp_path / "job" / "raw").exists()


def test_small_archives_that_compress_well_stay_under_the_ratio_floor(tmp_path: Path) -> None:
    # 60 flat BMPs expand several hundred times, but 43 MiB in all is below the floor where the ratio applies.
    archive = make_zip(
        [(f"flat{index}.bmp", make_image("BMP", size=(500, 500), color=(index, 9, 9))) for index in range(60)]
    )

    prepared = prepare(tmp_path / "job", archive, resolution=512)

    assert 60 * 500 * 500 * 3 / len(archive) > 100
    assert prepared.instance_images == 60


# ------------------------------------------------------------------------------------ decoding


def test_the_repeated_directory_attack_on_one_large_image_is_refused_before_decoding(tmp_path: Path) -> None:
    image = flat_png(7000, 7000, (30, 60, 90))
    archive = zip_listing_one_member_many_times(deflated(image), ["big.png"] * 40)

    work = measured(lambda: prepare(tmp_path / "job", archive))

    assert isinstance(work.outcome, FluxboothError)
    assert work.outcome.message.startswith("dataset: members 'big.png' and 'big.png' point at the same")
    assert work.cpu_seconds < REFUSAL_CPU_SECONDS
    assert work.bytes_written <= len(archive) + 64 * 1024


def test_identical_images_are_decoded_once_and_stored_once(tmp_path: Path) -> None:
    image = flat_png(3000, 3000, (30, 60, 90))
    archive = make_zip([(f"copy{index:02d}.png", image) for index in range(40)])
    extracted_bytes = 40 * len(image)

    work = measured(lambda: prepare(tmp_path / "job", archive, resolution=512))

    assert isinstance(work.outcome, PreparedDataset)
    prepared = work.outcome
    assert prepared.instance_images == 40
    assert prepared.pixels == 3000 * 3000
    assert len({path.stat().st_ino for path in prepared.instance_dir.glob("*.png")}) == 1
    assert work.bytes_written <= len(archive) + extracted_bytes + stored_bytes(prepared) + 64 * 1024
    # One 9-megapixel decode, resize and save; 40 of them took about 40 times as long.
    assert work.cpu_seconds < 5.0


def test_images_over_the_dataset_pixel_budget_are_refused_before_decoding(tmp_path: Path) -> None:
    # Headers declaring 7000 x (7000 - index) pixels over a few bytes of data: 4.6 Gpx in all.
    archive = make_zip([(f"huge{index}.png", make_oversized_png(7000, 7000 - index)) for index in range(95)])
    declared = sum(7000 * (7000 - index) for index in range(95))

    work = measured(lambda: prepare(tmp_path / "job", archive))

    assert isinstance(work.outcome, FluxboothError)
    assert work.outcome.code is ErrorCode.INVALID_DATASET
    assert work.outcome.message == (
        f"dataset: the images hold {declared:,} pixels in total, over the 4,000,000,000-pixel budget "
        "(FLUXBOOTH_MAX_DATASET_PIXELS); use fewer or smaller images"
    )
    assert work.cpu_seconds < REFUSAL_CPU_SECONDS
    assert not (tmp_path / "job" / "data").exists()


def test_identical_files_count_once_against_the_pixel_budget(tmp_path: Path) -> None:
    archive = make_zip([(f"copy{index}.png", make_image("PNG", size=(100, 100))) for index in range(3)])

    prepared = prepare(tmp_path / "job", archive, DatasetLimits(max_dataset_pixels=100 * 100))

    assert prepared.pixels == 100 * 100


# ------------------------------------------------------------------------------------ disk written


def test_the_tall_thin_attack_is_cropped_and_compressed_writing_a_fraction_of_the_upload(tmp_path: Path) -> None:
    # The measured attack at a quarter of its linear scale (its full size runs in bench/dataset_budgets.py):
    # a dozen 256 x 12800 strips, whose short side is under the 512 training resolution, used to be
    # stored uncompressed at their own size: 118 MB.
    strips = [(f"strip{index:02d}.png", flat_png(256, 12800, (index * 20, 100, 200))) for index in range(12)]
    archive = make_zip(strips)
    extracted_bytes = sum(len(data) for _, data in strips)
    uncompressed_before = 12 * 256 * 12800 * 3

    work = measured(lambda: prepare(tmp_path / "job", archive, resolution=512))

    assert isinstance(work.outcome, PreparedDataset)
    prepared = work.outcome
    assert prepared.cropped == 12
    for path in prepared.instance_dir.glob("*.png"):
        with Image.open(path) as stored:
            assert stored.size == (256, 1024)
    assert stored_bytes(prepared) < 12 * 256 * 1024 * 3 / 100  # compressed: flat strips take almost nothing
    assert work.bytes_written <= len(archive) + extracted_bytes + stored_bytes(prepared) + 64 * 1024
    assert work.bytes_written < uncompressed_before / 100
    assert work.cpu_seconds < 1.0 + prepared.pixels / 10e6


def test_an_image_longer_than_the_cap_keeps_its_middle(tmp_path: Path) -> None:
    bands = Image.new("RGB", (100, 900), (255, 0, 0))
    bands.paste((0, 255, 0), (0, 300, 100, 600))
    bands.save(tmp_path / "tall.png")

    result = normalise_image(
        tmp_path / "tall.png", tmp_path / "out.png", member="tall.png", limits=LIMITS, resolution=(64, 64)
    )

    with Image.open(tmp_path / "out.png") as stored:
        assert stored.size == (64, 256)
        assert stored.getpixel((32, 128)) == (0, 255, 0)
        assert stored.getpixel((32, 0))[0] > 200  # 50 px of red above the middle band survive the crop
    assert (result.width, result.height, result.cropped) == (64, 256, True)


def test_a_training_shape_longer_than_the_cap_keeps_that_shape(tmp_path: Path) -> None:
    make_image(tmp_path / "wide.png", size=(2000, 100))

    result = normalise_image(
        tmp_path / "wide.png", tmp_path / "out.png", member="wide.png", limits=LIMITS, resolution=(1024, 128)
    )

    assert (result.width, result.height, result.cropped) == (800, 100, True)


def test_the_aspect_cap_is_a_setting(tmp_path: Path) -> None:
    make_image(tmp_path / "wide.png", size=(900, 100))

    result = normalise_image(
        tmp_path / "wide.png",
        tmp_path / "out.png",
        member="wide.png",
        limits=DatasetLimits(max_image_aspect_ratio=9.0),
        resolution=(64, 64),
    )

    assert result.cropped is False


def test_cropped_images_are_noted_in_the_summary(tmp_path: Path) -> None:
    archive = make_zip([*dataset_members(3), ("strip.png", make_image("PNG", size=(96, 960)))])

    prepared = prepare(tmp_path / "job", archive, resolution=64)

    assert prepared.summary()["cropped"] == 1
    assert "1 image(s) are longer than 4:1 and were cropped to their middle, the part training uses" in prepared.notes


def test_stored_images_are_compressed(tmp_path: Path) -> None:
    make_image(tmp_path / "flat.png", size=(1024, 1024))

    normalise_image(
        tmp_path / "flat.png", tmp_path / "out.png", member="flat.png", limits=LIMITS, resolution=(1024, 1024)
    )

    assert (tmp_path / "out.png").stat().st_size < 1024 * 1024 * 3 / 100


def test_stored_size_never_exceeds_its_bound(tmp_path: Path) -> None:
    noise = Image.frombytes("RGB", (300, 200), random.Random(3).randbytes(300 * 200 * 3))
    noise.save(tmp_path / "noise.png")

    normalise_image(
        tmp_path / "noise.png", tmp_path / "out.png", member="noise.png", limits=LIMITS, resolution=(512, 512)
    )

    assert 300 * 200 * 3 < (tmp_path / "out.png").stat().st_size <= stored_bytes_bound(300, 200, (512, 512), 4.0)


def test_images_over_the_stored_bytes_budget_are_refused_before_decoding(tmp_path: Path) -> None:
    archive = make_zip(dataset_members(3, size=(96, 96)))
    bound = 3 * stored_bytes_bound(96, 96, (512, 512), 4.0)

    error = refusal(tmp_path / "job", archive, DatasetLimits(max_prepared_bytes=bound - 1), resolution=512)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        f"dataset: the normalised images could take {format_bytes(bound)} of disk at 512 px (aspect buckets), over the "
        f"{format_bytes(bound - 1)} budget (FLUXBOOTH_MAX_PREPARED_BYTES); use fewer images or a lower resolution"
    )
    assert not (tmp_path / "job" / "data").exists()


# ------------------------------------------------------------------------------------ a full disk


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount a real tmpfs of a given size (tests.conftest.mounted_tmpfs: root, as in this project's CI container,
    where FLUXBOOTH_REQUIRE_TMPFS=1 makes a failed mount fail the test instead of skipping it)."""
    numbers = itertools.count()
    with contextlib.ExitStack() as mounted:

        def mount(size_bytes: int) -> Path:
            target = tmp_path / f"fs{next(numbers)}"
            target.mkdir()
            return mounted.enter_context(mounted_tmpfs(target, size_bytes))

        yield mount


def fill(filesystem: Path) -> None:
    """Write until the filesystem is full: another writer taking the disk during preparation."""
    with (filesystem / "filler").open("ab", buffering=0) as sink:
        for chunk in (MiB, 4096, 1):
            try:
                while True:
                    sink.write(b"\0" * chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC


def test_a_small_filesystem_is_does_not_fit_before_the_dataset_is_stored(
    small_filesystem: Callable[[int], Path],
) -> None:
    filesystem = small_filesystem(8 * MiB)
    archive = make_zip(dataset_members(3))

    error = refusal(filesystem / "job", archive)

    assert error.code is ErrorCode.DOES_NOT_FIT
    free = shutil.disk_usage(filesystem).free
    assert error.message == (
        f"disk: storing the dataset needs about {format_bytes(len(archive) + 64 * MiB)} but only "
        f"{format_bytes(free)} are free under {filesystem / 'job'}; free disk space, use a bigger volume or a "
        "smaller dataset"
    )
    assert error.details == {"needed_bytes": len(archive) + 64 * MiB, "free_bytes": free}


def test_a_disk_that_fills_up_while_images_are_stored_is_does_not_fit_with_the_numbers(
    small_filesystem: Callable[[int], Path],
) -> None:
    filesystem = small_filesystem(72 * MiB)
    archive = make_zip(dataset_members(3))
    needed = 3 * stored_bytes_bound(96, 96, (512, 512), 4.0) + 64 * MiB

    with pytest.raises(FluxboothError) as caught:
        prepare(filesystem / "job", archive, on_image=lambda done, total: fill(filesystem), resolution=512)

    error = caught.value
    assert error.code is ErrorCode.DOES_NOT_FIT
    assert error.details["needed_bytes"] == needed
    assert error.message == (
        f"disk: the disk filled up while storing the normalised images, which needs about {format_bytes(needed)}; "
        f"{format_bytes(error.details['free_bytes'])} were free under {filesystem / 'job' / 'data'} when it "
        "began. Free disk space or use a bigger volume"
    )
    assert error.details["free_bytes"] >= needed


def test_a_filesystem_with_room_for_the_zip_but_not_its_contents_is_does_not_fit_before_extracting(
    small_filesystem: Callable[[int], Path],
) -> None:
    filesystem = small_filesystem(72 * MiB)
    # 5 MiB stored (not deflated): storing it needs 69 MiB, and extracting it 69 MiB more than the zip takes.
    archive = make_zip(
        [*dataset_members(3), ("noise.png", random.Random(5).randbytes(5 * MiB))], compression=zipfile.ZIP_STORED
    )
    declared = sum(len(data) for _, data in dataset_members(3)) + 5 * MiB

    error = refusal(filesystem / "job", archive)

    assert error.code is ErrorCode.DOES_NOT_FIT
    assert error.details["needed_bytes"] == declared + 64 * MiB
    assert error.details["free_bytes"] < declared + 64 * MiB
    assert error.message == (
        f"disk: extracting the dataset needs about {format_bytes(declared + 64 * MiB)} but only "
        f"{format_bytes(error.details['free_bytes'])} are free under {filesystem / 'job' / 'raw'}; free disk "
        "space, use a bigger volume or a smaller dataset"
    )


# ------------------------------------------------------------------------------------ settings


def test_the_budgets_are_read_from_the_environment_per_job() -> None:
    limits = WorkerSettings.from_environ(
        {
            "FLUXBOOTH_MAX_ARCHIVE_EXPANSION_RATIO": "20",
            "FLUXBOOTH_MAX_DATASET_PIXELS": "1000000",
            "FLUXBOOTH_MAX_IMAGE_ASPECT_RATIO": "2.5",
            "FLUXBOOTH_MAX_PREPARED_BYTES": "5000000",
        }
    ).dataset_limits

    assert (
        limits.max_archive_expansion_ratio,
        limits.max_dataset_pixels,
        limits.max_image_aspect_ratio,
        limits.max_prepared_bytes,
    ) == (20, 1_000_000, 2.5, 5_000_000)


def test_the_budget_defaults() -> None:
    limits = WorkerSettings.from_environ({}).dataset_limits

    assert (
        limits.max_archive_expansion_ratio,
        limits.max_dataset_pixels,
        limits.max_image_aspect_ratio,
        limits.max_prepared_bytes,
        limits.max_expanded_bytes,
    ) == (100, 4_000_000_000, 4.0, 16 * 1024**3, 4 * 1024**3)


def test_an_aspect_cap_below_one_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_environ({"FLUXBOOTH_MAX_IMAGE_ASPECT_RATIO": "0.5"})

    assert str(caught.value) == "environment variable FLUXBOOTH_MAX_IMAGE_ASPECT_RATIO='0.5' must be 1 or more"


def test_the_handler_process_imports_no_numpy_for_the_dataset() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import sys, fluxbooth.dataset; print(sorted({'numpy', 'torch'} & set(sys.modules)))"],
        capture_output=True,
        text=True,
        check=True,
    )

    assert result.stdout.strip() == "[]"
