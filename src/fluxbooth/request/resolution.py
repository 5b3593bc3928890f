"""The request's `resolution` (**contract**): the sizes and shapes a caller may spell, parsed into a `Resolution`.

`resolution` is the one request field with several spellings, because the reference guide writes it as a string
(`"1024x1024"`, a fixed shape) and ai-toolkit and Replicate as sizes (`[512, 768, 1024]`, `"512,768,1024"`: aspect
buckets).
"""

from __future__ import annotations

import re

from fluxbooth.contract.buckets import BUCKET_MULTIPLE, Resolution

MIN_RESOLUTION_SIDE = 64
MAX_RESOLUTION_SIDE = 2048
MAX_RESOLUTION_SIZES = 8
# No crop beyond rounding to a multiple of 16, as ai-toolkit trains by default; "WxH" keeps the guide's crop.
DEFAULT_RESOLUTION = Resolution(sizes=(1024,))

_FIXED_RESOLUTION_TEXT = re.compile(r"^\s*(\d{1,5})\s*[xX×]\s*(\d{1,5})\s*$")
_SIZES_TEXT = re.compile(r"^\s*\d{1,5}\s*(?:,\s*\d{1,5}\s*)*$")


def _checked_size(size: int) -> int:
    if not MIN_RESOLUTION_SIDE <= size <= MAX_RESOLUTION_SIDE or size % BUCKET_MULTIPLE:
        raise ValueError(
            f"each size must be a multiple of {BUCKET_MULTIPLE} between {MIN_RESOLUTION_SIDE} and "
            f"{MAX_RESOLUTION_SIDE}, got {size}"
        )
    return size


def _bucketed(sizes: list[int]) -> Resolution:
    if not sizes:
        raise ValueError("needs at least one size")
    if len(set(sizes)) > MAX_RESOLUTION_SIZES:
        raise ValueError(f"takes at most {MAX_RESOLUTION_SIZES} sizes")
    return Resolution(sizes=tuple(sorted({_checked_size(size) for size in sizes})))


def _fixed(width: int, height: int) -> Resolution:
    for side in (width, height):
        if not MIN_RESOLUTION_SIDE <= side <= MAX_RESOLUTION_SIDE or side % BUCKET_MULTIPLE:
            raise ValueError(
                f"each side must be a multiple of {BUCKET_MULTIPLE} between "
                f"{MIN_RESOLUTION_SIDE} and {MAX_RESOLUTION_SIDE}, got {width}x{height}"
            )
    return Resolution(fixed=(width, height))


def parse_resolution(value: object) -> Resolution:
    """`1024` or `"1024"`: aspect buckets at one size; `[512, 768, 1024]` (ai-toolkit's spelling) or
    `"512,768,1024"` (Replicate's): aspect buckets at each size; `"768x1024"` (width x height): that one
    shape, every image centre-cropped to it (the reference guide's `"1024x1024"`)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return _bucketed([value])
    if isinstance(value, list) and all(isinstance(size, int) and not isinstance(size, bool) for size in value):
        return _bucketed(value)
    if isinstance(value, str):
        fixed = _FIXED_RESOLUTION_TEXT.match(value)
        if fixed is not None:
            return _fixed(int(fixed.group(1)), int(fixed.group(2)))
        if _SIZES_TEXT.match(value):
            return _bucketed([int(size) for size in value.split(",")])
    raise ValueError(
        "expected a size like 1024, sizes like [512, 768, 1024] (aspect buckets) or a fixed shape like "
        "'768x1024' (width x height)"
    )
