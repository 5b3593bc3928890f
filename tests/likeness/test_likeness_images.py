"""Scoring reads photos and renders as the dataset stage reads photos (fluxbooth.dataset.images.read_image): upright
by their EXIF orientation, 16-bit greyscale scaled to 8 bits, shrunk as they are read so a phone's 24-megapixel
photo costs at most SCORED_SIDE² pixels; a file that cannot be read is an input error of the `score` command
naming it (exit 2, no traceback); files it does not read are named in its output.

Face-free checks read the pixels through `load_image`, the one reader scoring uses; the end-to-end ones run dlib's
real weights on the public-domain astronaut portrait (tests/support/likeness_fixtures.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fluxbooth.cli import main
from fluxbooth.dataset.guards import quoted
from fluxbooth.likeness.inputs import SCORED_SIDE, load_image
from tests.support.factories import make_oversized_png
from tests.support.likeness_fixtures import astronaut, offline_environ, save_all, views

EXIF_ORIENTATION = 0x0112
ROTATE_90_CLOCKWISE = 6  # the EXIF value a phone held upright writes: the pixels are stored lying on their side
RED, BLUE = (255, 0, 0), (0, 0, 255)
READABLE = "JPEG/PNG/WEBP/BMP/GIF/TIFF/HEIF/AVIF"


def save_tagged(image: Image.Image, path: Path, orientation: int) -> Path:
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = orientation
    image.save(path, "JPEG", quality=95, exif=exif.tobytes())
    return path


def lying_on_its_side(upright: Image.Image) -> Image.Image:
    """The pixels a phone stores for `upright` with orientation 6: turned a quarter anticlockwise."""
    return upright.transpose(Image.Transpose.ROTATE_90)


def score(tmp_path: Path, *arguments: str) -> tuple[int, dict]:
    out = io.StringIO()
    code = main(["score", *arguments], environ=offline_environ(tmp_path), out=out)
    return code, json.loads(out.getvalue())


def test_a_photo_tagged_exif_orientation_6_is_read_upright(tmp_path: Path) -> None:
    stored = Image.new("RGB", (300, 200), RED)
    stored.paste(BLUE, (150, 0, 300, 200))  # stored left red, right blue: upright, red on top
    image = load_image(save_tagged(stored, tmp_path / "phone.jpg", ROTATE_90_CLOCKWISE))
    assert image.size == (200, 300)
    top, bottom = image.getpixel((100, 10)), image.getpixel((100, 290))
    assert max(abs(a - b) for a, b in zip(top, RED, strict=True)) < 8
    assert max(abs(a - b) for a, b in zip(bottom, BLUE, strict=True)) < 8


def test_16_bit_greyscale_is_read_as_its_grey_not_white(tmp_path: Path) -> None:
    Image.new("I;16", (96, 96), 32768).save(tmp_path / "scan.png")  # half of 16-bit full scale
    image = load_image(tmp_path / "scan.png")
    assert (image.mode, image.getpixel((40, 40))) == ("RGB", (128, 128, 128))


@pytest.mark.parametrize("suffix", [".jpg", ".png"])
def test_a_phone_sized_photo_is_decoded_no_larger_than_the_scored_side(tmp_path: Path, suffix: str) -> None:
    # 6000x4000 is what 16 phone photos took 1.6 GB at; each is now held at SCORED_SIDE on its longer side.
    path = tmp_path / f"phone{suffix}"
    Image.new("RGB", (6000, 4000), (90, 140, 200)).save(path)
    assert load_image(path).size == (SCORED_SIDE, round(4000 * SCORED_SIDE / 6000))


UNREADABLE = {
    "empty.png": (
        lambda path: path.write_bytes(b""),
        f"is not a readable {READABLE} file; re-export it as JPEG or PNG",
    ),
    "notes.jpg": (
        lambda path: path.write_text("not a photo\n"),
        f"is not a readable {READABLE} file; re-export it as JPEG or PNG",
    ),
    "cut.png": (
        lambda path: path.write_bytes(noise_png()[:20_000]),
        "is truncated or corrupt (image file is truncated); re-export it",
    ),
    "huge.png": (
        lambda path: path.write_bytes(make_oversized_png(30_000, 30_000)),
        "declares 900,000,000 pixels, over the 50,000,000-pixel cap; downscale it",
    ),
}


def noise_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("name", list(UNREADABLE))
def test_an_unreadable_photo_is_an_input_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    write, reason = UNREADABLE[name]
    save_all([astronaut()], tmp_path / "photos", "photo")
    save_all([astronaut()], tmp_path / "renders")
    write(tmp_path / "photos" / name)
    out = io.StringIO()
    code = main(
        ["score", "--photos", str(tmp_path / "photos"), "--renders", str(tmp_path / "renders")],
        environ=offline_environ(tmp_path),
        out=out,
    )
    assert (code, out.getvalue()) == (2, "")
    assert (
        capsys.readouterr().err == f"error (invalid_input): image {quoted(str(tmp_path / 'photos' / name))} {reason}\n"
    )


@pytest.fixture
def astronaut_photos(tmp_path: Path) -> Path:
    save_all(list(views(astronaut(), ("original", "crop_and_scale", "colour_shift")).values()), tmp_path / "photos")
    return tmp_path / "photos"


def test_an_unreadable_render_is_an_input_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], astronaut_photos: Path
) -> None:
    save_all([astronaut()], tmp_path / "renders")
    (tmp_path / "renders" / "render_01.png").write_bytes(b"")
    code = main(
        ["score", "--photos", str(astronaut_photos), "--renders", str(tmp_path / "renders")],
        environ=offline_environ(tmp_path),
        out=io.StringIO(),
    )
    assert code == 2
    assert capsys.readouterr().err == (
        f"error (invalid_input): image {quoted(str(tmp_path / 'renders' / 'render_01.png'))} "
        f"is not a readable {READABLE} file; re-export it as JPEG or PNG\n"
    )


def test_photos_stored_on_their_side_are_scored_upright(tmp_path: Path) -> None:
    (tmp_path / "photos").mkdir()
    for number, view in enumerate(views(astronaut(), ("original", "crop_and_scale", "colour_shift")).values()):
        save_tagged(lying_on_its_side(view), tmp_path / "photos" / f"phone_{number}.jpg", ROTATE_90_CLOCKWISE)
    save_all(list(views(astronaut(), ("rotation", "flip")).values()), tmp_path / "renders")
    code, result = score(tmp_path, "--photos", str(tmp_path / "photos"), "--renders", str(tmp_path / "renders"))
    assert code == 0
    assert result["subject_type_source"] == "auto: 3 of 3 photos hold exactly one face"
    assert (result["face_detect_rate"], result["face_match_rate"]) == (1.0, 1.0)


def test_gif_and_tiff_renders_are_scored_and_files_it_cannot_read_are_named(
    tmp_path: Path, astronaut_photos: Path
) -> None:
    renders = tmp_path / "renders"
    save_all([astronaut()], renders)
    for suffix, view in zip((".gif", ".tif"), views(astronaut(), ("rotation", "flip")).values(), strict=True):
        view.save(renders / f"render{suffix}")
    (renders / "render.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    code, result = score(tmp_path, "--photos", str(astronaut_photos), "--renders", str(renders))
    assert (code, result["renders"], result["face_detect_rate"]) == (0, 3, 1.0)
    assert result["not_scored"]["count"] == 1 and result["not_scored"]["files"] == [str(renders / "render.svg")]
    assert result["not_scored"]["reason"].startswith("not an image format the command reads (.avif, .bmp, ")
