"""Training shapes: the request's `resolution`, and the aspect-ratio bucket each image trains in.

`resolution` is either a fixed `WxH` shape (every image scaled to cover it and centre-cropped, as the
reference guide trains) or a list of sizes (aspect buckets, as ai-toolkit and kohya train): at each size,
an image trains in the bucket of its own aspect ratio at about size² pixels, its sides rounded to multiples
of 16, so a centre crop to it removes no more than that rounding.

Pure and torch-free: the request, the dataset stage, the planner and the trainer share these answers.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

# FLUX packs 2x2 patches of 8x-downsampled latents: one token per 16x16 pixels, so sides are multiples of 16.
BUCKET_MULTIPLE = 16

Shape = tuple[int, int]  # (width, height)


def _nearest_multiple(value: float) -> int:
    return max(BUCKET_MULTIPLE, BUCKET_MULTIPLE * round(value / BUCKET_MULTIPLE))


def _landscape_bucket(aspect: float, size: int) -> Shape:
    """The bucket at `size` of a landscape `aspect` (at least 1): the long side is size·√aspect, the short
    side that long side over `aspect`, each rounded to the nearest multiple of 16. Only the short side's
    rounding departs from the image's own shape: that is all a centre crop to the bucket removes."""
    long = _nearest_multiple(size * math.sqrt(aspect))
    return (long, min(long, _nearest_multiple(long / aspect)))


def bucket_for(width: int, height: int, size: int) -> Shape:
    """The training shape of a `width` x `height` image at `size`: its own aspect ratio at about size²
    pixels, sides multiples of 16. A portrait image gets the transpose of what its landscape twin gets, so
    the answer does not depend on which way a photo is turned."""
    if width >= height:
        return _landscape_bucket(width / height, size)
    landscape = _landscape_bucket(height / width, size)
    return (landscape[1], landscape[0])


@dataclass(frozen=True)
class Resolution:
    """What the request's `resolution` asks for: aspect buckets at `sizes`, or one `fixed` shape."""

    sizes: tuple[int, ...] = ()  # ascending; each image trains once at each
    fixed: Shape | None = None  # "WxH": every image scaled to cover it, then centre-cropped

    @property
    def bucketed(self) -> bool:
        return self.fixed is None

    @property
    def render_shape(self) -> Shape:
        """The one shape that stands for the request: the fixed shape, else the largest size square
        (validation images and generated class images render at it)."""
        if self.fixed is not None:
            return self.fixed
        return (self.sizes[-1], self.sizes[-1])

    def shapes_for(self, width: int, height: int) -> tuple[Shape, ...]:
        """The shapes a `width` x `height` image trains at: its bucket at each size, or the fixed shape."""
        if self.fixed is not None:
            return (self.fixed,)
        return tuple(bucket_for(width, height, size) for size in self.sizes)

    def training_shape(self, width: int, height: int) -> Shape:
        """The shape a `width` x `height` image trains at its largest size (what a crop preview shows)."""
        return self.shapes_for(width, height)[-1]

    def to_json(self) -> str | list[int]:
        """As a request spells it: "WxH" for a fixed shape, the list of sizes for buckets."""
        if self.fixed is not None:
            return f"{self.fixed[0]}x{self.fixed[1]}"
        return list(self.sizes)

    @classmethod
    def from_json(cls, value: str | list[int]) -> Resolution:
        """What `to_json` wrote: "WxH" a fixed shape, a list the bucket sizes (train.json carries it so)."""
        if isinstance(value, str):
            width, _, height = value.partition("x")
            return cls(fixed=(int(width), int(height)))
        return cls(sizes=tuple(int(size) for size in value))

    def describe(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed[0]}x{self.fixed[1]}"
        return f"{', '.join(str(size) for size in self.sizes)} px (aspect buckets)"


def bucket_mix(resolution: Resolution, image_sizes: Iterable[Shape]) -> Counter[Shape]:
    """How many samples (an image at one size) each training shape gets."""
    mix: Counter[Shape] = Counter()
    for width, height in image_sizes:
        mix.update(resolution.shapes_for(width, height))
    return mix


def mix_to_json(mix: Counter[Shape] | dict[Shape, int]) -> list[dict[str, int]]:
    """A bucket mix as the result reports it: one entry per shape, in (width, height) order."""
    return [{"width": width, "height": height, "images": count} for (width, height), count in sorted(mix.items())]
