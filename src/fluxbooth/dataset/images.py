"""One uploaded image → the file the trainer reads: decoded fully (so a bad file fails here, naming it),
EXIF-transposed, converted to 8-bit sRGB and stored no larger than training needs. Captions too."""

from __future__ import annotations

import functools
import io
import math
import re
import struct
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captions import MAX_CAPTION_CHARS
from fluxbooth.dataset.guards import dataset_error, quoted
from fluxbooth.messages import format_bytes
from fluxbooth.settings import DatasetLimits

# HEIF is the iPhone's HEIC (read through pi-heif's plugin); Pillow reads AVIF itself.
ALLOWED_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "HEIF", "AVIF")

# zlib's fastest level with run-length matching only, because it costs less than the disk it saves: about
# 35 ms more CPU per megapixel than an uncompressed save, for 0.65 of the raw size on photo-like images
# (1 MB saved per megapixel) and 0.002 on flat ones, where the disk attacks live (bench/dataset_budgets.py).
# Pillow's default level costs twice as much for no further gain; it was 80 % of preparation time.
PNG_COMPRESS_LEVEL = 1
PNG_COMPRESS_TYPE = zlib.Z_RLE
PNG_CHUNK_BYTES = 64 * 1024  # Pillow fills data chunks of at least this (ImageFile.MAXBLOCK), 12 bytes of framing each
PNG_HEADER_BYTES = 1024  # signature, IHDR, IEND and the small ancillary chunks Pillow may add
WHITE = (255, 255, 255)
# Downscales tried before an image is stored at its own size (each a little larger than the last).
COVERING_ATTEMPTS = 4


@dataclass(frozen=True)
class NormalisedImage:
    width: int
    height: int
    downscaled: bool
    cropped: bool = False  # longer than the aspect cap: only its middle was kept


def _to_eight_bit(image: Image.Image) -> Image.Image:
    """16-bit and float greyscale → 8-bit 'L', scaling instead of clipping."""
    if image.mode.startswith("I;16"):
        image = image.convert("I")
    if image.mode == "I":
        _, high = cast("tuple[float, float]", image.getextrema())  # one band: (min, max), not one per band
        if high > 255:
            image = image.point(lambda value: value * (1 / 256))
        return image.convert("L")
    if image.mode == "F":
        _, high = cast("tuple[float, float]", image.getextrema())  # one band: (min, max), not one per band
        if high <= 1.0:
            image = image.point(lambda value: value * 255)
        return image.convert("L")
    return image


def _to_srgb(image: Image.Image, icc_profile: bytes | None) -> Image.Image:
    """Honour an embedded colour profile (Display P3 phones, CMYK print files) when there is one."""
    if not icc_profile or image.mode not in ("RGB", "RGBA", "CMYK"):
        return image
    try:
        source_profile = ImageCms.ImageCmsProfile(io.BytesIO(icc_profile))
        output_mode = "RGBA" if image.mode == "RGBA" else "RGB"
        converted = ImageCms.profileToProfile(
            image, source_profile, ImageCms.createProfile("sRGB"), outputMode=output_mode
        )
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError):
        # A broken profile should not sink the photo: fall back to Pillow's plain conversion.
        return image
    return converted if converted is not None else image


def _to_rgb(image: Image.Image) -> Image.Image:
    icc_profile = image.info.get("icc_profile")
    image = _to_eight_bit(image)
    has_alpha = image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info
    if has_alpha:
        image = image.convert("RGBA")
    elif image.mode not in ("RGB", "CMYK"):
        image = image.convert("RGB")
    image = _to_srgb(image, icc_profile)
    if image.mode == "RGBA":
        background = Image.new("RGB", image.size, WHITE)
        background.paste(image, mask=image.getchannel("A"))
        return background
    return image.convert("RGB") if image.mode != "RGB" else image


def _transposed(image: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(image) or image
    except (OSError, ValueError, TypeError, KeyError, struct.error, ZeroDivisionError, SyntaxError):
        # Unreadable EXIF is common in edited photos; the pixels are still fine.
        return image


def as_resolution(resolution: Resolution | tuple[int, int]) -> Resolution:
    """A (width, height) is a fixed training shape."""
    return resolution if isinstance(resolution, Resolution) else Resolution(fixed=resolution)


def _covering_size(width: int, height: int, resolution: Resolution) -> tuple[int, int] | None:
    """The smallest size that still covers every shape the trainer scales this image to, without carrying
    24-megapixel PNGs through the job; None when no downscale is needed. A fixed shape: the shorter side at
    the shape's longer side (enough for any resize-and-crop); buckets: the image's bucket at each size."""
    if resolution.fixed is not None:
        target_short = max(resolution.fixed)
        short = min(width, height)
        if short <= target_short:
            return None
        scale = target_short / short
        new_width = target_short if width == short else max(target_short, round(width * scale))
        new_height = target_short if height == short else max(target_short, round(height * scale))
        return new_width, new_height
    # The trainer buckets the stored image by its own size, whose rounding can tip it into the neighbouring
    # bucket: grow the scale until the stored size covers its own buckets too.
    scale = _scale_to_cover(width, height, resolution)
    for _ in range(COVERING_ATTEMPTS):
        if scale >= 1:
            return None
        # Rounded first: 400 x 0.56 is 224.00000000000003 in floating point, which must not become 225.
        stored = (math.ceil(round(width * scale, 6)), math.ceil(round(height * scale, 6)))
        shortfall = _scale_to_cover(*stored, resolution)
        if shortfall <= 1:
            return stored
        scale *= shortfall
    return None


def _scale_to_cover(width: int, height: int, resolution: Resolution) -> float:
    """The scale at which a `width` x `height` image covers each of its training shapes."""
    return max(max(shape[0] / width, shape[1] / height) for shape in resolution.shapes_for(width, height))


def middle_crop_box(
    width: int, height: int, resolution: Resolution, max_aspect: float
) -> tuple[int, int, int, int] | None:
    """The middle of an image longer than `max_aspect`:1 (or than a fixed training shape, when that is
    longer), as a (left, top, right, bottom) box; None when the image is within the cap.

    The trainer scales each image to cover its training shape and keeps the middle, so this crop removes
    only pixels it would never use, while a 1:50 strip can no longer fill the disk. An aspect bucket has the
    image's own shape, so only the cap applies."""
    target_width, target_height = resolution.fixed or (1, 1)
    if width >= height:
        cap = max(max_aspect, target_width / target_height)
        if width <= height * cap:
            return None
        kept = max(1, round(height * cap))
        left = (width - kept) // 2
        return left, 0, left + kept, height
    cap = max(max_aspect, target_height / target_width)
    if height <= width * cap:
        return None
    kept = max(1, round(width * cap))
    top = (height - kept) // 2
    return 0, top, width, top + kept


def stored_size(width: int, height: int, resolution: Resolution, max_aspect: float) -> tuple[int, int]:
    """The size an image is stored at: its middle within the aspect cap, downscaled to cover its training shapes."""
    box = middle_crop_box(width, height, resolution, max_aspect)
    if box is not None:
        width, height = box[2] - box[0], box[3] - box[1]
    return _covering_size(width, height, resolution) or (width, height)


def stored_bytes_bound(width: int, height: int, resolution: Resolution | tuple[int, int], max_aspect: float) -> int:
    """The most bytes the stored PNG can take, whichever way its EXIF orientation turns it: the raw rows
    (a filter byte each) under zlib's worst-case expansion (its compressBound), plus the PNG chunks' framing
    (counted as if a chunk could end at every row too, which costs nothing and assumes nothing of Pillow)."""
    largest = 0
    shapes = as_resolution(resolution)
    for oriented in ((width, height), (height, width)):
        stored_width, stored_height = stored_size(*oriented, shapes, max_aspect)
        raw = stored_height * (3 * stored_width + 1)
        deflated = raw + (raw >> 12) + (raw >> 14) + (raw >> 25) + 13
        chunks = deflated // PNG_CHUNK_BYTES + 1 + stored_height
        largest = max(largest, deflated + 12 * chunks + PNG_HEADER_BYTES)
    return largest


@dataclass(frozen=True)
class ImageHeader:
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


@functools.cache
def register_heif_decoder() -> None:
    """pi-heif's Pillow plugin, once per process, decoding only the primary picture (no thumbnails, depth
    maps or auxiliary images: nothing the trainer uses is worth their decode time). libheif applies the
    file's rotation and mirroring itself and resets the EXIF orientation, so a photo is turned once.

    pi-heif is pillow-heif's decoder-only build: libheif and libde265 (LGPL) without the x265 encoder that
    pillow-heif's wheels bundle (GPL), which the worker never needs and its image would otherwise ship."""
    from pi_heif import register_heif_opener  # deferred: loads libheif when the first photo is decoded, not at import

    register_heif_opener(thumbnails=False, depth_images=False, aux_images=False)


# What a reader raises for an unreadable image: each stage its own kind (the dataset stage its INVALID_DATASET
# error, the `score` command an input error, the report a warning), the message naming the file.
ImageError = Callable[[str], Exception]


@contextmanager
def _opened_image(
    source: Path, shown: str, max_pixels: int, min_side: int, error: ImageError = dataset_error
) -> Iterator[Image.Image]:
    """`source` opened (its header read, nothing decoded) and checked against the per-image caps; Pillow's
    own pixel cap is set to ours while it is open."""
    register_heif_decoder()
    previous_cap = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its cap and raises above; the size check below is exact.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                opened = Image.open(source, formats=ALLOWED_IMAGE_FORMATS)
            except Image.DecompressionBombError as bomb:
                declared = re.search(r"\((\d+) pixels\)", str(bomb))
                amount = f"{int(declared.group(1)):,}" if declared else "too many"
                raise error(
                    f"image {shown} declares {amount} pixels, over the {max_pixels:,}-pixel cap; downscale it"
                ) from None
            except UnidentifiedImageError:
                raise error(
                    f"image {shown} is not a readable {'/'.join(ALLOWED_IMAGE_FORMATS)} file; "
                    "re-export it as JPEG or PNG"
                ) from None
            except (OSError, SyntaxError, ValueError, EOFError, struct.error) as corrupt:
                raise error(f"image {shown} is corrupt ({corrupt}); re-export it") from None
            with opened:
                width, height = opened.size
                if width * height > max_pixels:
                    raise error(
                        f"image {shown} declares {width}x{height} pixels, over the {max_pixels:,}-pixel cap; "
                        "downscale it"
                    )
                if min(width, height) < min_side:
                    raise error(
                        f"image {shown} is {width}x{height}; the shorter side must be at least "
                        f"{min_side} px. Use a larger photo or remove it"
                    )
                yield opened
    finally:
        Image.MAX_IMAGE_PIXELS = previous_cap


def read_header(source: Path, *, member: str, limits: DatasetLimits) -> ImageHeader:
    """The image's declared size, read without decoding it, after the per-image checks."""
    with _opened_image(source, quoted(member), limits.max_image_pixels, limits.min_image_side) as opened:
        return ImageHeader(*opened.size)


def _decoded(opened: Image.Image, shown: str, max_pixels: int, error: ImageError = dataset_error) -> None:
    try:
        opened.load()
    except Image.DecompressionBombError:
        raise error(f"image {shown} has frames over the {max_pixels:,}-pixel cap; downscale it") from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as corrupt:
        raise error(f"image {shown} is truncated or corrupt ({corrupt}); re-export it") from None


def normalise_image(
    source: Path,
    destination: Path,
    *,
    member: str,
    limits: DatasetLimits,
    resolution: Resolution | tuple[int, int],
) -> NormalisedImage:
    """Decode `source` fully (first frame), EXIF-transpose, keep its middle within the aspect cap, convert
    to 8-bit sRGB, downscale to cover its training shapes and save as a fast-compressed PNG."""
    shown = quoted(member)
    shapes = as_resolution(resolution)
    with _opened_image(source, shown, limits.max_image_pixels, limits.min_image_side) as opened:
        planned_size = _covering_size(*opened.size, shapes)
        if planned_size is not None and opened.format in ("JPEG", "MPO"):
            # JPEG can decode at 1/2, 1/4 or 1/8 scale directly; it still reads the whole stream.
            opened.draft(opened.mode, planned_size)
        _decoded(opened, shown, limits.max_image_pixels)
        # Everything happens while `opened` is open: a closed Pillow image refuses further work.
        image = _transposed(opened)
        box = middle_crop_box(image.width, image.height, shapes, limits.max_image_aspect_ratio)
        if box is not None:
            image = image.crop(box)
        image = _to_rgb(image)
        target_size = _covering_size(image.width, image.height, shapes)
        if target_size is not None:
            image = image.resize(target_size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        # No colour profile: the pixels are sRGB now, and a copied profile would be unbounded bytes.
        image.save(
            destination,
            format="PNG",
            compress_level=PNG_COMPRESS_LEVEL,
            compress_type=PNG_COMPRESS_TYPE,
            icc_profile=None,
        )
        # `planned_size` also counts a JPEG that draft() already reduced on decode.
        downscaled = planned_size is not None or target_size is not None
        return NormalisedImage(width=image.width, height=image.height, downscaled=downscaled, cropped=box is not None)


def read_image(
    source: Path,
    *,
    name: str,
    max_side: int,
    error: ImageError = dataset_error,
    max_pixels: int = DatasetLimits.max_image_pixels,
) -> Image.Image:
    """`source` read as the dataset stage reads a photo (the pixel cap, the first frame decoded in full so a
    truncated file fails, EXIF orientation applied, 16-bit, palette and CMYK to 8-bit sRGB RGB) and shrunk as
    it is read to at most `max_side` on its longer side: a JPEG decodes at 1/2 to 1/8 scale, any other format
    is reduced right after its decode, so what a caller keeps is at most max_side² RGB pixels. An unreadable
    file raises `error(message)`, the message naming it as `name`."""
    shown = quoted(name)
    with _opened_image(source, shown, max_pixels, 1, error) as opened:
        if opened.format in ("JPEG", "MPO"):
            # draft() keeps the decoded size at or above the one asked for; thumbnail() below does the rest.
            opened.draft(opened.mode, (max_side, max_side))
        _decoded(opened, shown, max_pixels, error)
        image = _to_rgb(_transposed(opened))
        image.thumbnail((max_side, max_side), Image.Resampling.LANCZOS, reducing_gap=3.0)
        # A copy when nothing above made one: the pixels must outlive the file, which closes here.
        return image.copy() if image is opened else image


def read_caption(path: Path, *, member: str) -> str:
    """UTF-8 caption text, whitespace collapsed to single spaces; empty means 'no caption'."""
    shown = quoted(member)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise dataset_error(f"caption {shown} is not UTF-8 text; save it as UTF-8") from None
    text = " ".join(text.split())
    if "\x00" in text:
        raise dataset_error(f"caption {shown} contains NUL bytes; save it as plain UTF-8 text")
    if len(text) > MAX_CAPTION_CHARS:
        raise dataset_error(f"caption {shown} has {len(text)} characters; the limit is {MAX_CAPTION_CHARS}. Shorten it")
    return text


def check_image_budgets(
    images: Iterable[tuple[str, Path, str]], resolution: Resolution, limits: DatasetLimits
) -> tuple[int, int]:
    """Before any image is decoded: read each distinct file's header (`images` holds (key, path, member),
    equal keys for identical files) and refuse a dataset over the pixel or the stored-bytes budget.
    Returns (pixels to decode, most bytes the stored images can take)."""
    headers: dict[str, ImageHeader] = {}
    for key, path, member in images:
        if key not in headers:
            headers[key] = read_header(path, member=member, limits=limits)
    pixels = sum(header.pixels for header in headers.values())
    if pixels > limits.max_dataset_pixels:
        raise dataset_error(
            f"the images hold {pixels:,} pixels in total, over the {limits.max_dataset_pixels:,}-pixel budget "
            "(FLUXBOOTH_MAX_DATASET_PIXELS); use fewer or smaller images"
        )
    stored = sum(
        stored_bytes_bound(header.width, header.height, resolution, limits.max_image_aspect_ratio)
        for header in headers.values()
    )
    if stored > limits.max_prepared_bytes:
        raise dataset_error(
            f"the normalised images could take {format_bytes(stored)} of disk at {resolution.describe()}, "
            f"over the {format_bytes(limits.max_prepared_bytes)} budget (FLUXBOOTH_MAX_PREPARED_BYTES); "
            "use fewer images or a lower resolution"
        )
    return pixels, stored
