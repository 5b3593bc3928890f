"""One uploaded image → the file the trainer reads: decoded fully (so a bad file fails here, naming it),
EXIF-transposed, converted to 8-bit sRGB and stored no larger than training needs. Captions too."""

from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageCms, ImageOps, UnidentifiedImageError

from fluxbooth.dataset.guards import dataset_error, quoted
from fluxbooth.settings import DatasetLimits

ALLOWED_IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF")

MAX_CAPTION_CHARS = 2000

PNG_COMPRESS_LEVEL = 0  # stored, not deflated: the trainer reads each file once, and deflate was 80 % of preparation time (bench/overhead.py)
WHITE = (255, 255, 255)


@dataclass(frozen=True)
class NormalisedImage:
    width: int
    height: int
    downscaled: bool


def _to_eight_bit(image: Image.Image) -> Image.Image:
    """16-bit and float greyscale → 8-bit 'L', scaling instead of clipping."""
    if image.mode.startswith("I;16"):
        image = image.convert("I")
    if image.mode == "I":
        _, high = image.getextrema()
        if high > 255:
            image = image.point(lambda value: value * (1 / 256))
        return image.convert("L")
    if image.mode == "F":
        _, high = image.getextrema()
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


def _covering_size(width: int, height: int, resolution: tuple[int, int]) -> tuple[int, int] | None:
    """The smallest size whose shorter side is max(resolution): still enough for any resize-and-crop the
    trainer does, without carrying 24-megapixel PNGs through the job. None when no downscale is needed."""
    target_short = max(resolution)
    short = min(width, height)
    if short <= target_short:
        return None
    scale = target_short / short
    new_width = target_short if width == short else max(target_short, round(width * scale))
    new_height = target_short if height == short else max(target_short, round(height * scale))
    return new_width, new_height


def normalise_image(
    source: Path,
    destination: Path,
    *,
    member: str,
    limits: DatasetLimits,
    resolution: tuple[int, int],
) -> NormalisedImage:
    """Decode `source` fully (first frame), EXIF-transpose, convert to 8-bit sRGB, save as PNG."""
    shown = quoted(member)
    previous_cap = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = limits.max_image_pixels
    try:
        with warnings.catch_warnings():
            # Pillow warns between 1x and 2x its cap and raises above; the size check below is exact.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                opened = Image.open(source, formats=ALLOWED_IMAGE_FORMATS)
            except Image.DecompressionBombError as error:
                declared = re.search(r"\((\d+) pixels\)", str(error))
                amount = f"{int(declared.group(1)):,}" if declared else "too many"
                raise dataset_error(
                    f"image {shown} declares {amount} pixels, over the {limits.max_image_pixels:,}-pixel cap; "
                    "downscale it"
                ) from None
            except UnidentifiedImageError:
                raise dataset_error(
                    f"image {shown} is not a readable {'/'.join(ALLOWED_IMAGE_FORMATS)} file; "
                    "re-export it as JPEG or PNG"
                ) from None
            except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
                raise dataset_error(f"image {shown} is corrupt ({error}); re-export it") from None
            with opened:
                width, height = opened.size
                if width * height > limits.max_image_pixels:
                    raise dataset_error(
                        f"image {shown} declares {width}x{height} pixels, over the "
                        f"{limits.max_image_pixels:,}-pixel cap; downscale it"
                    )
                if min(width, height) < limits.min_image_side:
                    raise dataset_error(
                        f"image {shown} is {width}x{height}; the shorter side must be at least "
                        f"{limits.min_image_side} px. Use a larger photo or remove it"
                    )
                planned_size = _covering_size(width, height, resolution)
                if planned_size is not None and opened.format in ("JPEG", "MPO"):
                    # JPEG can decode at 1/2, 1/4 or 1/8 scale directly; it still reads the whole stream.
                    opened.draft(opened.mode, planned_size)
                try:
                    opened.load()
                except Image.DecompressionBombError:
                    raise dataset_error(
                        f"image {shown} has frames over the {limits.max_image_pixels:,}-pixel cap; downscale it"
                    ) from None
                except (OSError, SyntaxError, ValueError, EOFError, struct.error, MemoryError) as error:
                    raise dataset_error(f"image {shown} is truncated or corrupt ({error}); re-export it") from None
                # Everything happens while `opened` is open: a closed Pillow image refuses further work.
                image = _to_rgb(_transposed(opened))
                target_size = _covering_size(image.width, image.height, resolution)
                if target_size is not None:
                    image = image.resize(target_size, Image.Resampling.LANCZOS, reducing_gap=3.0)
                image.save(destination, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
                # `planned_size` also counts a JPEG that draft() already reduced on decode.
                downscaled = planned_size is not None or target_size is not None
                return NormalisedImage(width=image.width, height=image.height, downscaled=downscaled)
    finally:
        Image.MAX_IMAGE_PIXELS = previous_cap


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
        raise dataset_error(
            f"caption {shown} has {len(text)} characters; the limit is {MAX_CAPTION_CHARS}. Shorten it"
        )
    return text
