"""Photo-like test images for the dataset check and the training report, built in memory.

`textured_photo` draws distinct scenes with sharp edges and sensor-like grain (so sharpness and the
perceptual hash behave as on camera photos); `portrait` and `two_people` crop the portrait matplotlib ships
as sample data (Grace Hopper, a real photo with one frontal face), so face counts are tested on a real face.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageOps

# Crops of the sample portrait (512x600) in which OpenCV's frontal-face cascade finds her face at 96-384 px.
PORTRAIT_CROPS = ((0, 0, 512, 600), (40, 20, 472, 560), (80, 40, 512, 520))


def textured_photo(seed: int, size: tuple[int, int] = (256, 256)) -> Image.Image:
    """A distinct scene per seed: a wavy colour field with grain and a dozen sharp-edged shapes."""
    generator = np.random.default_rng(seed)
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = generator.uniform(40, 215, 3)
    field = np.stack(
        [base[c] + 30 * np.sin(x / (17 + 5 * c) + generator.uniform(0, 6)) + 20 * np.cos(y / 23) for c in range(3)], -1
    )
    field += generator.normal(0, 6, field.shape)
    image = Image.fromarray(np.clip(field, 0, 255).astype("uint8"))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        left, top = int(generator.integers(0, width)), int(generator.integers(0, height))
        right = left + int(generator.integers(width // 12, width // 3))
        bottom = top + int(generator.integers(height // 12, height // 3))
        color = tuple(int(value) for value in generator.integers(0, 256, 3))
        shape = draw.ellipse if generator.random() < 0.5 else draw.rectangle
        shape((left, top, right, bottom), fill=color)
    return image


def blurred(image: Image.Image, radius: float) -> Image.Image:
    return image.filter(ImageFilter.GaussianBlur(radius))


def encoded(image: Image.Image, image_format: str = "JPEG", quality: int = 92) -> bytes:
    buffer = io.BytesIO()
    options = {"quality": quality} if image_format == "JPEG" else {}
    image.save(buffer, format=image_format, **options)
    return buffer.getvalue()


def png_size(path: Path) -> tuple[int, int]:
    """The size of a PNG file, fully decoded (a truncated or mislabelled file fails here)."""
    with Image.open(path) as image:
        image.load()
        assert image.format == "PNG"
        return image.size


def _sample_portrait() -> Image.Image:
    from matplotlib import cbook

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as opened:
        return opened.convert("RGB")


def portrait(index: int, side: int = 256) -> Image.Image:
    """One face, framed a little differently per index (distinct enough not to be near duplicates)."""
    return ImageOps.fit(_sample_portrait().crop(PORTRAIT_CROPS[index % len(PORTRAIT_CROPS)]), (side, side))


def two_people(side: int = 256) -> Image.Image:
    """The portrait beside its mirror image: two faces."""
    face = _sample_portrait()
    pair = Image.new("RGB", (face.width * 2, face.height))
    pair.paste(face, (0, 0))
    pair.paste(face.transpose(Image.Transpose.FLIP_LEFT_RIGHT), (face.width, 0))
    return pair.resize((side, side * face.height // (face.width * 2)))


# What `flawed_dataset_members` holds that the dataset check must name, and nothing else.
DUPLICATED = ("photo0.jpg", "photo0 copy.jpg", "photo0 re-encoded.jpg")
BLURRED = "photo4 blurred.jpg"


def flawed_dataset_members(size: tuple[int, int] = (256, 256)) -> list[tuple[str, bytes]]:
    """Four distinct photos, photo0 twice more (a byte-identical copy, and re-encoded at JPEG quality 40), and a
    fifth photo blurred."""
    photos = [textured_photo(seed, size) for seed in range(5)]
    members = [(f"photo{index}.jpg", encoded(photo)) for index, photo in enumerate(photos[:4])]
    members.append((DUPLICATED[1], members[0][1]))
    members.append((DUPLICATED[2], encoded(photos[0], quality=40)))
    members.append((BLURRED, encoded(blurred(photos[4], radius=8 * size[0] / 256))))
    return members


# Where `subject_photo` places the subject, as fractions of the room left beside and below it: six distinct places.
SUBJECT_PLACES = ((0.05, 0.1), (0.9, 0.15), (0.4, 0.85), (0.0, 0.95), (0.85, 0.8), (0.5, 0.45))


def toy_subject(side: int) -> Image.Image:
    """A drawn toy (body, head, eyes, a patch) with grain, on a transparent ground: the same subject every call."""
    toy = Image.new("RGBA", (side, side), (0, 0, 0, 0))
    draw = ImageDraw.Draw(toy)
    unit = side / 10
    draw.ellipse((unit, 4 * unit, 9 * unit, 10 * unit), fill=(200, 70, 40, 255))
    draw.ellipse((2.5 * unit, 0, 7.5 * unit, 4.8 * unit), fill=(230, 200, 60, 255))
    for left in (3.6, 5.4):
        draw.ellipse((left * unit, 1.6 * unit, (left + 1) * unit, 2.6 * unit), fill=(20, 20, 20, 255))
    draw.rectangle((3 * unit, 5.5 * unit, 5 * unit, 8 * unit), fill=(40, 60, 170, 255))
    pixels = np.asarray(toy).astype(np.float64)
    pixels[..., :3] += np.random.default_rng(0).normal(0, 12, pixels[..., :3].shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8"), "RGBA")


def subject_photo(background: int, place: int, size: tuple[int, int] = (256, 256), share: float = 0.3) -> Image.Image:
    """The toy, `share` of the shorter side, at SUBJECT_PLACES[place] on a plain grainy background whose colour
    is drawn from the seed `background`: the studio shots a DreamBooth set is made of, and the case a
    difference hash confused (a plain background hashes alike in any colour)."""
    generator = np.random.default_rng(100 + background)
    width, height = size
    ground = generator.uniform(30, 220, 3) + generator.normal(0, 4, (height, width, 3))
    photo = Image.fromarray(np.clip(ground, 0, 255).astype("uint8"))
    toy = toy_subject(round(share * min(size)))
    across, down = SUBJECT_PLACES[place]
    photo.paste(toy, (round(across * (width - toy.width)), round(down * (height - toy.height))), toy)
    return photo
