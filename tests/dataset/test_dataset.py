"""Dataset preparation: from base64 or a URL to clean image folders, and every way an upload can be bad."""

from __future__ import annotations

import io
import ipaddress
import stat
import time
import zipfile
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageCms, ImageFile

from fluxbooth.dataset import (
    PreparedDataset,
    decode_base64_dataset,
    download_dataset,
    extract_archive,
    forbidden_address_reason,
    normalise_image,
    prepare_dataset,
)
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import DatasetLimits
from tests.support.factories import (
    dataset_members,
    make_dataset_zip,
    make_image,
    make_oversized_png,
    make_zip,
    to_base64,
)
from tests.support.http_fixtures import LocalHTTPServer

LIMITS = DatasetLimits()
LOCAL_LIMITS = DatasetLimits(allow_private_urls=True, download_timeout_seconds=5)


def files_under(root: Path) -> set[Path]:
    return {path for path in root.rglob("*")}


@pytest.fixture
def job_dir(tmp_path: Path) -> Iterator[Path]:
    """The job directory, and a check that nothing appeared anywhere else under tmp_path."""
    job = tmp_path / "job"
    before = files_under(tmp_path)
    yield job
    outside = {path for path in files_under(tmp_path) - before if not path.is_relative_to(job)}
    assert outside == set(), f"written outside the job directory: {outside}"


def prepare(job_dir: Path, archive: bytes, limits: DatasetLimits = LIMITS, **fields: Any) -> PreparedDataset:
    raw = {"model_name": "sks-dog", "dataset": to_base64(archive), "instance_prompt": "a photo of sks dog"}
    return prepare_dataset(dataset_spec(parse_request({**raw, **fields})), job_dir, limits)


def refusal(job_dir: Path, archive: bytes, limits: DatasetLimits = LIMITS, **fields: Any) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        prepare(job_dir, archive, limits, **fields)
    return caught.value


def dataset_refusal(job_dir: Path, archive: bytes, limits: DatasetLimits = LIMITS, **fields: Any) -> str:
    error = refusal(job_dir, archive, limits, **fields)
    assert error.code is ErrorCode.INVALID_DATASET, error.message
    return error.message


def with_images(*extra: tuple[str, bytes], count: int = 3) -> bytes:
    """A valid dataset plus `extra` members."""
    return make_zip([*dataset_members(count), *extra])


def png_names(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.glob("*.png"))


# ------------------------------------------------------------------------------------------ happy path


def test_images_become_rgb_pngs_in_the_instance_dir(job_dir: Path) -> None:
    prepared = prepare(job_dir, make_dataset_zip(count=4, image_format="JPEG"))

    assert prepared.instance_dir == job_dir.resolve() / "data" / "instance"
    assert png_names(prepared.instance_dir) == ["photo0.png", "photo1.png", "photo2.png", "photo3.png"]
    for path in prepared.instance_dir.glob("*.png"):
        with Image.open(path) as image:
            assert (image.format, image.mode) == ("PNG", "RGB")
    assert prepared.instance_images == 4
    assert prepared.class_dir is None


def test_summary_reports_counts(job_dir: Path) -> None:
    prepared = prepare(job_dir, with_images(("notes.pdf", b"%PDF-1.4")), resolution=512)

    assert prepared.summary() == {
        "instance_images": 3,
        "class_images": 0,
        "control_images": 0,
        "captions": 0,
        "skipped": {"not_image": 1},
        "smaller_than_resolution": 3,
        "downscaled": 0,
        "cropped": 0,
        "pixels": 3 * 96 * 96,
        "notes": [
            "3 image(s) are smaller than their aspect bucket at 512 px and will be upscaled; larger photos train sharper"
        ],
        "trigger_word": None,
        "buckets": [{"width": 512, "height": 512, "images": 3}],
    }


def test_scratch_files_are_removed_after_preparation(job_dir: Path) -> None:
    prepare(job_dir, make_dataset_zip())

    assert sorted(path.name for path in job_dir.iterdir()) == ["data"]


def test_captions_beside_images_are_kept_with_the_same_stem(job_dir: Path) -> None:
    prepared = prepare(job_dir, make_dataset_zip(count=3, captions=True))

    assert prepared.captions == 3
    assert (prepared.instance_dir / "photo1.txt").read_text(encoding="utf-8") == "a photo of sks dog, pose 1\n"


def test_caption_whitespace_and_bom_are_cleaned(job_dir: Path) -> None:
    archive = with_images(("photo0.txt", "\ufeff  sks dog\n on  grass \r\n".encode()))

    prepared = prepare(job_dir, archive)

    assert (prepared.instance_dir / "photo0.txt").read_text(encoding="utf-8") == "sks dog on grass\n"


def test_caption_that_is_not_utf8_is_refused_naming_it(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("photo0.txt", b"\xff\xfe\xfa bad")))

    assert message == "dataset: caption 'photo0.txt' is not UTF-8 text; save it as UTF-8"


def test_caption_over_2000_characters_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("photo0.txt", b"word " * 500)))

    assert "caption 'photo0.txt' has 2499 characters; the limit is 2000" in message


def test_caption_without_an_image_is_skipped_and_counted(job_dir: Path) -> None:
    prepared = prepare(job_dir, with_images(("lonely.txt", b"sks dog")))

    assert prepared.skipped == {"unpaired_caption": 1}
    assert prepared.captions == 0


def test_class_folder_goes_to_the_class_dir(job_dir: Path) -> None:
    prepared = prepare(
        job_dir,
        make_dataset_zip(count=3, class_images=2),
        with_prior_preservation=True,
        class_prompt="a photo of a dog",
    )

    assert prepared.class_dir == job_dir.resolve() / "data" / "class"
    assert png_names(prepared.class_dir) == ["dog0.png", "dog1.png"]
    assert (prepared.instance_images, prepared.class_images) == (3, 2)


def test_class_images_without_prior_preservation_are_noted(job_dir: Path) -> None:
    prepared = prepare(job_dir, make_dataset_zip(count=3, class_images=1))

    assert "the archive's class/ images are unused because with_prior_preservation is false" in prepared.notes


def test_zip_of_a_folder_is_read_from_inside_the_folder(job_dir: Path) -> None:
    members = [(f"my-dog/{name}", data) for name, data in dataset_members(3, class_images=1)]

    prepared = prepare(job_dir, make_zip(members))

    assert (prepared.instance_images, prepared.class_images) == (3, 1)


def test_images_in_subfolders_are_flattened(job_dir: Path) -> None:
    archive = make_zip([("a/one.png", make_image("PNG")), ("b/c/two.png", make_image("PNG")), *dataset_members(1)])

    prepared = prepare(job_dir, archive)

    assert png_names(prepared.instance_dir) == ["one.png", "photo0.png", "two.png"]


def test_duplicate_names_after_flattening_keep_every_image(job_dir: Path) -> None:
    archive = make_zip(
        [("a/photo.png", make_image("PNG")), ("b/photo.png", make_image("PNG")), ("photo.png", make_image("PNG"))]
    )

    prepared = prepare(job_dir, archive)

    assert png_names(prepared.instance_dir) == ["photo-2.png", "photo-3.png", "photo.png"]


def test_duplicate_member_names_in_the_archive_keep_every_image(job_dir: Path) -> None:
    archive = make_zip([("photo.png", make_image("PNG"))] * 3)

    prepared = prepare(job_dir, archive)

    assert prepared.instance_images == 3


def test_two_entries_of_one_name_stay_two_in_the_per_file_results(job_dir: Path) -> None:
    archive = make_zip(
        [
            ("dup.jpg", make_image("JPEG", color=(200, 10, 10))),
            ("dup.jpg", make_image("JPEG", color=(10, 10, 200))),
            ("other.jpg", make_image("JPEG")),
        ]
    )

    prepared = prepare(job_dir, archive)

    assert sorted(prepared.uploaded_names.values()) == ["dup.jpg", "dup.jpg (entry 2)", "other.jpg"]


def test_a_caption_differing_only_in_case_from_another_is_counted_as_skipped(job_dir: Path) -> None:
    archive = with_images(("Photo0.txt", b"first caption"), ("photo0.txt", b"second caption"))

    prepared = prepare(job_dir, archive)

    assert (prepared.captions, prepared.skipped) == (1, {"duplicate_caption": 1})


def test_junk_is_skipped_and_counted_by_kind(job_dir: Path) -> None:
    archive = with_images(
        ("__MACOSX/._photo0.png", b"\x00\x05\x16\x07"),
        ("__MACOSX/photo1.png", b"meta"),
        ("._photo2.png", b"\x00\x05\x16\x07"),
        (".DS_Store", b"\x00\x00\x00\x01Bud1"),
        (".hidden.png", make_image("PNG")),
        (".git/config", b"[core]"),
        ("readme.md", b"# my dog"),
        ("more.zip", make_dataset_zip(count=1)),
        ("backup.tar.gz", b"\x1f\x8b"),
        ("IMG_0001.JXL", b"\xff\x0a"),
        ("folder/", b""),
    )

    prepared = prepare(job_dir, archive)

    assert prepared.skipped == {
        "macos_metadata": 4,
        "hidden": 2,
        "not_image": 1,
        "nested_archive": 2,
        "unsupported_image_format": 1,
    }
    assert prepared.instance_images == 3


def test_images_smaller_than_the_resolution_are_counted(job_dir: Path) -> None:
    archive = make_zip([*dataset_members(2, size=(96, 96)), ("big.png", make_image("PNG", size=(256, 256)))])

    prepared = prepare(job_dir, archive, resolution=128)

    assert prepared.smaller_than_resolution == 2


def test_large_images_are_downscaled_to_just_cover_the_resolution(job_dir: Path) -> None:
    archive = with_images(("wide.jpg", make_image("JPEG", size=(1200, 800))), count=2)

    prepared = prepare(job_dir, archive, resolution="128x256")

    with Image.open(prepared.instance_dir / "wide.png") as image:
        assert image.size == (384, 256)
    assert prepared.downscaled == 1


# --------------------------------------------------------------------------------------------- base64


def test_data_uri_prefix_is_accepted(job_dir: Path) -> None:
    raw = {
        "model_name": "m",
        "instance_prompt": "sks",
        "dataset": "data:application/zip;base64," + to_base64(make_dataset_zip(count=3)),
    }

    prepared = prepare_dataset(dataset_spec(parse_request(raw)), job_dir, LIMITS)

    assert prepared.instance_images == 3


def test_base64_with_line_breaks_is_accepted() -> None:
    encoded = to_base64(b"PK\x05\x06" + b"\x00" * 18)
    wrapped = "\n".join(encoded[index : index + 4] for index in range(0, len(encoded), 4))

    assert decode_base64_dataset(wrapped, LIMITS) == b"PK\x05\x06" + b"\x00" * 18


def test_url_safe_base64_is_accepted() -> None:
    assert decode_base64_dataset("-_-_", LIMITS) == b"\xfb\xff\xbf"


def test_base64_with_invalid_characters_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        decode_base64_dataset("UEsD!!BBQ=", LIMITS)

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message.startswith("input.dataset: is not valid base64")


def test_base64_with_a_wrong_length_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        decode_base64_dataset("UEsDB", LIMITS)

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert "input.dataset: is not valid base64" in caught.value.message


def test_base64_over_the_cap_is_refused_before_decoding() -> None:
    # Invalid base64 on purpose: a decoder run before the size check would complain about the characters.
    with pytest.raises(FluxboothError) as caught:
        decode_base64_dataset("!" * 101, DatasetLimits(max_base64_chars=100))

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "input.dataset: is 101 characters of base64, over the 100 cap; send a link in dataset_url instead"
    )


def test_empty_base64_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        decode_base64_dataset("data:application/zip;base64, \n", LIMITS)

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message.startswith("input.dataset: is empty")


def test_bad_base64_writes_nothing(job_dir: Path) -> None:
    raw = {"model_name": "m", "instance_prompt": "sks", "dataset": "UEsD!!BBQ="}

    with pytest.raises(FluxboothError):
        prepare_dataset(dataset_spec(parse_request(raw)), job_dir, LIMITS)

    assert files_under(job_dir) == set()


# -------------------------------------------------------------------------------------------- archive


def test_not_a_zip_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, b"hello, these are not the images you are looking for")

    assert message == "dataset: the upload is not a zip archive; put the images in a .zip"


def test_gzip_upload_is_named_as_such(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, b"\x1f\x8b\x08\x00" + b"\x00" * 40)

    assert "the upload is a gzip file, not a zip archive" in message


def test_single_image_upload_is_named_as_such(job_dir: Path) -> None:
    assert "the upload is a single JPEG image, not a zip archive" in dataset_refusal(job_dir, make_image("JPEG"))


def test_truncated_zip_is_refused(job_dir: Path) -> None:
    archive = make_dataset_zip(count=3)

    message = dataset_refusal(job_dir, archive[: len(archive) // 2])

    assert message == (
        "dataset: the zip is truncated or damaged (no central directory found); re-create and re-upload it"
    )


def test_encrypted_member_is_refused(job_dir: Path) -> None:
    archive = make_zip(dataset_members(3), encrypt_flag=["photo1.png"])

    assert dataset_refusal(job_dir, archive) == "dataset: member 'photo1.png' is encrypted; re-zip without a password"


def test_unsupported_compression_is_refused_naming_the_method(job_dir: Path) -> None:
    archive = make_zip(dataset_members(3), compress_type_override={"photo2.png": 9})

    message = dataset_refusal(job_dir, archive)

    assert message == (
        "dataset: member 'photo2.png' uses unsupported compression (Deflate64); re-zip with standard Deflate"
    )


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA])
def test_other_standard_compressions_are_accepted(job_dir: Path, compression: int) -> None:
    prepared = prepare(job_dir, make_zip(dataset_members(3), compression=compression))

    assert prepared.instance_images == 3


def test_member_escaping_the_root_is_refused(tmp_path: Path, job_dir: Path) -> None:
    archive = with_images(("../evil.png", make_image("PNG")), ("../../evil.png", make_image("PNG")))

    message = dataset_refusal(job_dir, archive)

    assert message == "dataset: member '../evil.png' escapes the archive root; remove it and re-zip"
    assert not (tmp_path / "evil.png").exists()


def test_member_escaping_from_a_subfolder_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("photos/../../evil.png", make_image("PNG"))))

    assert "member 'photos/../../evil.png' escapes the archive root" in message


def test_absolute_member_path_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("/tmp/evil.png", make_image("PNG"))))

    assert message == "dataset: member '/tmp/evil.png' has an absolute path; re-zip with relative paths"


def test_drive_letter_member_path_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("C:/Windows/evil.png", make_image("PNG"))))

    assert "member 'C:/Windows/evil.png' starts with a drive letter" in message


def test_backslash_member_path_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("..\\evil.png", make_image("PNG"))))

    assert "member '..\\\\evil.png' uses backslashes in its path" in message


def test_symlink_member_is_refused_and_no_link_is_created(job_dir: Path) -> None:
    archive = make_zip(dataset_members(3), symlinks={"photo9.png": "/etc/passwd"})

    message = dataset_refusal(job_dir, archive)

    assert message == "dataset: member 'photo9.png' is a symbolic link; zip the real files instead"
    assert not any(path.is_symlink() for path in files_under(job_dir))


def test_fifo_member_is_refused(job_dir: Path) -> None:
    archive = make_zip(dataset_members(3), special_files={"pipe.png": stat.S_IFIFO})

    assert "member 'pipe.png' is not a regular file" in dataset_refusal(job_dir, archive)


def test_too_many_members_are_refused(job_dir: Path) -> None:
    archive = with_images(*[(f"note{index}.md", b"x") for index in range(10)])

    message = dataset_refusal(job_dir, archive, DatasetLimits(max_members=10))

    assert message == "dataset: the archive has 13 members, over the 10 cap; use fewer files"


def test_declared_expanded_size_over_the_cap_is_refused_before_extracting(job_dir: Path) -> None:
    # Headers claiming 3 GB per member; the real members are a few hundred bytes.
    archive = make_zip(dataset_members(3), declared_sizes={"photo0.png": 3 * 10**9, "photo1.png": 3 * 10**9})
    limits = DatasetLimits(max_member_bytes=4 * 1024**3, max_compression_ratio=10**9)

    message = dataset_refusal(job_dir, archive, limits)

    assert message == (
        "dataset: the archive declares 5.6 GiB of files, over the 4.0 GiB cap (FLUXBOOTH_MAX_EXPANDED_BYTES); "
        "use fewer or smaller images"
    )
    assert not (job_dir / "raw").exists()


def test_declared_total_over_the_cap_is_refused(job_dir: Path) -> None:
    archive = make_dataset_zip(count=3)

    total = sum(len(data) for _, data in dataset_members(3))

    message = dataset_refusal(job_dir, archive, DatasetLimits(max_expanded_bytes=total - 1))

    assert message == (
        f"dataset: the archive declares {total} B of files, over the {total - 1} B cap "
        "(FLUXBOOTH_MAX_EXPANDED_BYTES); use fewer or smaller images"
    )
    assert not (job_dir / "raw").exists()


def test_declared_member_size_over_the_per_file_cap_is_refused(job_dir: Path) -> None:
    archive = make_zip(dataset_members(3), declared_sizes={"photo0.png": 3_000_000_000})

    message = dataset_refusal(job_dir, archive)

    assert (
        message == "dataset: member 'photo0.png' declares 2.8 GiB, over the 256.0 MiB per-file cap; use smaller images"
    )


def test_suspicious_compression_ratio_is_refused(job_dir: Path) -> None:
    archive = with_images(("bomb.png", b"\x00" * (4 * 1024 * 1024)))

    message = dataset_refusal(job_dir, archive)

    assert "member 'bomb.png' expands" in message
    assert "(the cap is 200x), which looks like a zip bomb" in message


def test_headers_that_understate_the_size_stop_extraction(job_dir: Path) -> None:
    archive = make_zip(
        [("liar.png", make_image("PNG", size=(300, 300), mode="L")), *dataset_members(3)],
        declared_sizes={"liar.png": 100},
    )

    message = dataset_refusal(job_dir, archive)

    assert message.startswith("dataset: member 'liar.png' is corrupt")
    assert (job_dir / "raw" / "00000.png").stat().st_size <= 100


def test_archive_with_only_junk_is_refused_listing_what_was_skipped(job_dir: Path) -> None:
    archive = make_zip([("readme.md", b"#"), ("__MACOSX/._a.png", b"x"), ("more.zip", b"PK")])

    message = dataset_refusal(job_dir, archive)

    assert message == (
        "dataset: no usable instance images in the archive; skipped: 1 macos_metadata, 1 nested_archive, "
        "1 not_image. Put JPEG, PNG, WEBP, BMP, GIF, TIFF, HEIF, AVIF files in the zip"
    )


def test_archive_with_only_class_images_says_so(job_dir: Path) -> None:
    archive = make_zip([(f"class/{name}", data) for name, data in dataset_members(3)])

    assert "no usable instance images in the archive (class/ holds 3)" in dataset_refusal(job_dir, archive)


def test_fewer_than_the_minimum_images_are_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, make_dataset_zip(count=2))

    assert message == "dataset: found 2 instance image(s); at least 3 are needed. Add more photos"


def test_more_than_the_maximum_images_are_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, make_dataset_zip(count=5), DatasetLimits(max_images=4))

    assert message == "dataset: found 5 instance images; at most 4 are accepted"


def test_too_little_free_disk_is_refused_before_extracting(job_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("fluxbooth.dataset.shutil.disk_usage", lambda path: usage(10**9, 10**9, 1024**2))

    archive = make_dataset_zip(count=3)

    error = refusal(job_dir, archive)

    assert error.code is ErrorCode.DOES_NOT_FIT
    assert error.message == (
        f"disk: storing the dataset needs about 64.0 MiB but only 1.0 MiB are free under {job_dir.resolve()}; "
        "free disk space, use a bigger volume or a smaller dataset"
    )
    assert error.details == {"needed_bytes": len(archive) + 64 * 1024**2, "free_bytes": 1024**2}


def test_hostile_archive_leaves_no_scratch_outside_the_job(tmp_path: Path) -> None:
    job = tmp_path / "nested" / "job"
    before = files_under(tmp_path)

    with pytest.raises(FluxboothError):
        prepare(job, with_images(("../../escape.png", make_image("PNG"))))

    assert {path for path in files_under(tmp_path) - before if not path.is_relative_to(job)} == {tmp_path / "nested"}


# --------------------------------------------------------------------------------------------- images


def test_truncated_image_is_refused_naming_the_file(job_dir: Path) -> None:
    broken = make_image("PNG", size=(200, 200))[:300]

    message = dataset_refusal(job_dir, with_images(("holiday/broken.png", broken)))

    assert message.startswith("dataset: image 'holiday/broken.png' is truncated or corrupt")


def test_truncated_large_jpeg_is_caught_even_when_decoded_at_reduced_scale(job_dir: Path) -> None:
    broken = make_image("JPEG", size=(2000, 1500))[:20_000]

    message = dataset_refusal(job_dir, with_images(("big.jpg", broken)), resolution=256)

    assert message.startswith("dataset: image 'big.jpg' is truncated or corrupt")


def test_file_that_only_claims_to_be_an_image_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("fake.jpg", b"this is text")))

    assert message == (
        "dataset: image 'fake.jpg' is not a readable JPEG/PNG/WEBP/BMP/GIF/TIFF/HEIF/AVIF file; re-export it as JPEG or PNG"
    )


def test_image_format_outside_the_allowed_list_is_not_opened(job_dir: Path) -> None:
    # Pillow reads PPM fine; the worker must not even try.
    message = dataset_refusal(job_dir, with_images(("sneaky.png", make_image("PPM", size=(96, 96)))))

    assert "image 'sneaky.png' is not a readable JPEG/PNG/WEBP/BMP/GIF/TIFF/HEIF/AVIF file" in message


def test_image_declaring_too_many_pixels_is_refused_before_decoding(
    job_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The work, not the time: Pillow decodes pixel data only in ImageFile.load, so count its calls.
    decoded: list[str] = []
    real_load = ImageFile.ImageFile.load

    def counting_load(image: ImageFile.ImageFile) -> Any:
        decoded.append(image.format or "?")
        return real_load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)

    message = dataset_refusal(job_dir, with_images(("huge.png", make_oversized_png(60_000, 60_000))))

    assert message == (
        "dataset: image 'huge.png' declares 3,600,000,000 pixels, over the 50,000,000-pixel cap; downscale it"
    )
    assert decoded == []


def test_image_just_over_the_pixel_cap_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(
        job_dir, with_images(("wide.png", make_oversized_png(101, 100))), DatasetLimits(max_image_pixels=10_000)
    )

    assert message == "dataset: image 'wide.png' declares 101x100 pixels, over the 10,000-pixel cap; downscale it"


@pytest.mark.parametrize("outcome", ["success", "failure"])
def test_pillow_pixel_cap_is_restored_after_each_image(tmp_path: Path, outcome: str) -> None:
    previous = Image.MAX_IMAGE_PIXELS
    source = tmp_path / "image.png"
    source.write_bytes(make_image("PNG", size=(96, 96)) if outcome == "success" else make_oversized_png(9000, 9000))

    try:
        normalise_image(source, tmp_path / "out.png", member="image.png", limits=LIMITS, resolution=(512, 512))
    except FluxboothError:
        pass

    assert Image.MAX_IMAGE_PIXELS == previous


def test_image_below_the_minimum_side_is_refused(job_dir: Path) -> None:
    message = dataset_refusal(job_dir, with_images(("thumb.jpg", make_image("JPEG", size=(200, 40)))))

    assert message == (
        "dataset: image 'thumb.jpg' is 200x40; the shorter side must be at least 64 px. Use a larger photo or remove it"
    )


def normalised(tmp_path: Path, name: str, data: bytes, resolution: tuple[int, int] = (512, 512)) -> Image.Image:
    source = tmp_path / name
    source.write_bytes(data)
    destination = tmp_path / "out.png"
    normalise_image(source, destination, member=name, limits=LIMITS, resolution=resolution)
    image = Image.open(destination)
    image.load()
    return image


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    image = normalised(tmp_path, "portrait.jpg", make_image("JPEG", size=(120, 80), exif_orientation=6))

    assert image.size == (80, 120)


def test_cmyk_is_converted_to_rgb(tmp_path: Path) -> None:
    image = normalised(tmp_path, "print.jpg", make_image("JPEG", mode="CMYK", color=(0, 255, 255, 0)))

    assert image.mode == "RGB"
    assert image.getpixel((10, 10)) == (255, 0, 0)


def test_palette_image_keeps_its_colours(tmp_path: Path) -> None:
    image = normalised(tmp_path, "palette.png", make_image("PNG", mode="P", color=(10, 200, 30)))

    assert image.getpixel((10, 10)) == (10, 200, 30)


def test_palette_transparency_is_composited_on_white(tmp_path: Path) -> None:
    data = make_image("PNG", mode="P", color=(10, 200, 30), transparent_index=0)

    assert normalised(tmp_path, "palette.png", data).getpixel((10, 10)) == (255, 255, 255)


def test_alpha_is_composited_on_white(tmp_path: Path) -> None:
    data = make_image("PNG", mode="RGBA", color=(0, 0, 0, 0))

    assert normalised(tmp_path, "cutout.png", data).getpixel((10, 10)) == (255, 255, 255)


def test_half_transparent_pixels_blend_with_white(tmp_path: Path) -> None:
    data = make_image("PNG", mode="RGBA", color=(0, 0, 0, 128))

    assert normalised(tmp_path, "glass.png", data).getpixel((10, 10)) == (127, 127, 127)


def test_sixteen_bit_greyscale_is_scaled_not_clipped(tmp_path: Path) -> None:
    image = normalised(tmp_path, "scan.png", make_image("PNG", mode="I;16", color=40_000))

    assert image.mode == "RGB"
    assert image.getpixel((10, 10)) == (156, 156, 156)


def test_sixteen_bit_tiff_is_normalised(tmp_path: Path) -> None:
    image = normalised(tmp_path, "scan.tif", make_image("TIFF", mode="I;16", color=65_535))

    assert image.getpixel((10, 10)) == (255, 255, 255)


def test_embedded_srgb_profile_keeps_colours(tmp_path: Path) -> None:
    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    source = Image.new("RGB", (96, 96), (200, 80, 40))
    buffer = io.BytesIO()
    source.save(buffer, format="PNG", icc_profile=profile)

    red, green, blue = normalised(tmp_path, "profiled.png", buffer.getvalue()).getpixel((10, 10))

    assert abs(red - 200) <= 2 and abs(green - 80) <= 2 and abs(blue - 40) <= 2


def test_broken_colour_profile_does_not_sink_the_photo(tmp_path: Path) -> None:
    source = Image.new("RGB", (96, 96), (200, 80, 40))
    buffer = io.BytesIO()
    source.save(buffer, format="PNG", icc_profile=b"not an ICC profile")

    assert normalised(tmp_path, "odd.png", buffer.getvalue()).getpixel((10, 10)) == (200, 80, 40)


@pytest.mark.parametrize("image_format", ["GIF", "WEBP", "PNG"])
def test_animated_images_use_the_first_frame(tmp_path: Path, image_format: str) -> None:
    data = make_image(image_format, color=(255, 0, 0), frames=3)

    red, green, blue = normalised(tmp_path, f"anim.{image_format.lower()}", data).getpixel((10, 10))

    assert red > 240 and green < 16 and blue < 16


@pytest.mark.parametrize("image_format", ["BMP", "WEBP", "TIFF", "GIF", "JPEG", "PNG"])
def test_every_allowed_format_is_read(tmp_path: Path, image_format: str) -> None:
    assert normalised(tmp_path, "photo.img", make_image(image_format, size=(96, 80))).size == (96, 80)


# ---------------------------------------------------------------------------------------- dataset_url


def url_request(url: str) -> Any:
    return parse_request({"model_name": "m", "instance_prompt": "sks", "dataset_url": url})


def download_refusal(url: str, tmp_path: Path, limits: DatasetLimits = LOCAL_LIMITS) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        download_dataset(url, tmp_path / "dataset.zip", limits)
    assert not (tmp_path / "dataset.zip").exists()
    assert not (tmp_path / "dataset.zip.part").exists()
    return caught.value


def test_dataset_url_is_downloaded_and_prepared(job_dir: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/d.zip", body=make_dataset_zip(count=3, captions=True))

    prepared = prepare_dataset(dataset_spec(url_request(url)), job_dir, LOCAL_LIMITS)

    assert (prepared.instance_images, prepared.captions) == (3, 3)


def test_redirects_are_followed(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    http_server.add("/final.zip", body=b"PK-bytes")
    url = http_server.add("/start", status=302, redirect_to="/final.zip")

    assert download_dataset(url, tmp_path / "dataset.zip", LOCAL_LIMITS) == 8
    assert (tmp_path / "dataset.zip").read_bytes() == b"PK-bytes"


def test_a_redirect_to_port_0_is_refused(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/start", status=302, redirect_to="http://127.0.0.1:0/final.zip")

    error = download_refusal(url, tmp_path)

    assert (error.code, error.message) == (
        ErrorCode.INVALID_INPUT,
        "input.dataset_url: redirected to a URL with port 0, which no server listens on; check the URL",
    )


def test_loopback_url_is_refused_by_default(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/d.zip", body=b"PK")

    error = download_refusal(url, tmp_path, DatasetLimits())

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith("input.dataset_url: host '127.0.0.1' resolves to 127.0.0.1, a loopback address")
    assert http_server.requests == []


def test_localhost_name_is_refused_by_default(tmp_path: Path) -> None:
    error = download_refusal("http://localhost:9/d.zip", tmp_path, DatasetLimits())

    assert error.code is ErrorCode.INVALID_INPUT
    assert "host 'localhost' resolves to" in error.message


def test_redirect_to_cloud_metadata_is_refused_even_when_private_urls_are_allowed(
    tmp_path: Path, http_server: LocalHTTPServer
) -> None:
    url = http_server.add("/d.zip", status=302, redirect_to="http://169.254.169.254/latest/meta-data/")

    error = download_refusal(url, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert "resolves to 169.254.169.254, a link-local (the cloud metadata range) address" in error.message


def test_redirect_to_a_file_url_is_refused(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/d.zip", status=301, redirect_to="file:///etc/passwd")

    error = download_refusal(url, tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message == "input.dataset_url: redirected to a file: URL; only http and https are followed"


def test_ftp_url_is_refused(tmp_path: Path) -> None:
    error = download_refusal("ftp://example.com/d.zip", tmp_path)

    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message == "input.dataset_url: is a ftp: URL; only http and https are followed"


def test_endless_redirects_are_refused(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/loop", status=302, redirect_to="/loop")

    error = download_refusal(url, tmp_path)

    assert error.code is ErrorCode.INVALID_DATASET
    assert "more than 5 redirects" in error.message


def test_404_is_reported_clearly(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    error = download_refusal(http_server.url("/missing.zip"), tmp_path)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        f"dataset_url: the server answered 404 Not Found for {http_server.url('/missing.zip')}: "
        "nothing at that address; check the URL (presigned URLs expire)"
    )


def test_error_messages_never_show_the_query_string(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    http_server.add("/d.zip", status=403, body=b"denied")

    error = download_refusal(http_server.url("/d.zip?X-Amz-Signature=CANARY"), tmp_path)

    assert "403 Forbidden" in error.message
    assert "CANARY" not in error.message


def test_server_that_never_answers_times_out(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    # The server stalls for a minute (until the fixture stops it); the worker gives up after its 1 s timeout.
    # 30 s is a generous bound that a loaded 2-core machine still meets, and far below the server's stall, so
    # passing it shows the timeout ended the wait, not the server.
    stall_seconds, generous_bound_seconds = 60, 30
    url = http_server.add("/slow.zip", body=b"PK", delay_seconds=stall_seconds)
    started = time.monotonic()

    error = download_refusal(url, tmp_path, DatasetLimits(allow_private_urls=True, download_timeout_seconds=1))

    assert error.code is ErrorCode.INVALID_DATASET
    assert "did not answer within 1 s" in error.message
    assert time.monotonic() - started < generous_bound_seconds


def test_server_that_stalls_mid_body_times_out(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/slow.zip", body=b"PK\x03\x04" * 10, trickle_seconds=3)

    error = download_refusal(url, tmp_path, DatasetLimits(allow_private_urls=True, download_timeout_seconds=1))

    assert "stopped sending data for 1 s" in error.message


def test_trickling_server_hits_the_total_deadline(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/slow.zip", body=b"x" * 200, trickle_seconds=0.05)

    with pytest.raises(FluxboothError) as caught:
        download_dataset(url, tmp_path / "dataset.zip", LOCAL_LIMITS, total_timeout_seconds=0.5)

    assert "took too long" in caught.value.message


def test_declared_download_over_the_cap_is_refused_before_reading(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/big.zip", body=b"x" * 2000)

    error = download_refusal(url, tmp_path, DatasetLimits(allow_private_urls=True, max_download_bytes=1000))

    assert error.code is ErrorCode.INVALID_DATASET
    assert "is 2.0 KiB, over the 1000 B download cap; use a smaller dataset" in error.message


def test_undeclared_download_over_the_cap_is_cut_off(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/big.zip", body=b"x" * (3 * 1024 * 1024), content_length=None)

    error = download_refusal(url, tmp_path, DatasetLimits(allow_private_urls=True, max_download_bytes=1024 * 1024))

    assert "sent more than the 1.0 MiB download cap; use a smaller dataset" in error.message


def test_download_shorter_than_promised_is_refused(tmp_path: Path, http_server: LocalHTTPServer) -> None:
    url = http_server.add("/short.zip", body=b"x" * 100, content_length=1000)

    error = download_refusal(url, tmp_path)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == f"dataset_url: {url} promised 1,000 bytes but sent 100; try again"


def test_unreachable_server_is_reported(tmp_path: Path) -> None:
    with LocalHTTPServer() as server:
        url = server.url("/d.zip")
    # The server is stopped: its port now refuses connections.

    error = download_refusal(url, tmp_path)

    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message.startswith("dataset_url: cannot connect to 127.0.0.1:")


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.10", "private"),
        ("100.64.0.1", "not publicly routable"),
        ("169.254.169.254", "link-local (the cloud metadata range)"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("fd00::1", "private"),
        ("2002:7f00:1::", "loopback"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_policy(address: str, reason: str | None) -> None:
    assert forbidden_address_reason(ipaddress.ip_address(address), allow_private=False) == reason


def test_private_addresses_are_allowed_by_the_switch_but_metadata_is_not() -> None:
    assert forbidden_address_reason(ipaddress.ip_address("10.1.2.3"), allow_private=True) is None
    assert forbidden_address_reason(ipaddress.ip_address("169.254.169.254"), allow_private=True) is not None


# ------------------------------------------------------------------------------------ lower-level API


def test_extract_archive_names_files_itself(tmp_path: Path) -> None:
    archive_path = tmp_path / "d.zip"
    archive_path.write_bytes(make_zip([("a/b/weird name!.PNG", make_image("PNG")), *dataset_members(2)]))

    extracted = extract_archive(archive_path, tmp_path / "raw", LIMITS)

    assert [image.path.name for image in extracted.images] == ["00000.png", "00001.png", "00002.png"]
    assert [image.member for image in extracted.images] == ["a/b/weird name!.PNG", "photo0.png", "photo1.png"]
