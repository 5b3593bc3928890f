"""The dataset stage's work budgets at the scale of the measured attacks, and the numbers behind the defaults.

1. The attacks, full size: what each uploads, how it ends, the bytes this thread wrote and its CPU seconds.
2. How to store the normalised images: PNG save and read time and size per zlib level and strategy.
3. Decoding rates (CPU megapixels per second), behind the FLUXBOOTH_MAX_DATASET_PIXELS default.

`python bench/dataset_budgets.py` prints the tables and rewrites its section of bench/RESULTS.md.
Images are synthetic (this repository ships no photos): "photo-like" is a blurred random colour field
with sensor-like grain, which compresses about as a camera photo does.
"""

from __future__ import annotations

import base64
import io
import platform
import statistics
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

from bench.overhead import write_section  # noqa: E402
from tests.support.hostile_zips import (  # noqa: E402
    MiB,
    deflated,
    flat_png,
    repeated_deflate,
    sparse_block,
    zip_listing_one_member_many_times,
)

REPEATS = 3


def bytes_written_by_this_thread() -> int:
    for line in Path("/proc/thread-self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/thread-self/io")


def run_attack(name: str, archive: bytes, work: Path, **fields: object) -> str:
    from fluxbooth.dataset import prepare_dataset
    from fluxbooth.errors import FluxboothError
    from fluxbooth.request.model import parse_request
    from fluxbooth.settings import DatasetLimits

    request = parse_request(
        {
            "model_name": "bench",
            "instance_prompt": "a photo of sks",
            "dataset": base64.b64encode(archive).decode(),
            **fields,
        }
    )
    written, cpu = bytes_written_by_this_thread(), time.thread_time()
    try:
        prepared = prepare_dataset(request, work / name.replace(" ", "-"), DatasetLimits())
        outcome = f"prepared: {prepared.instance_images} images, {prepared.cropped} cropped, {prepared.pixels:,} px"
    except FluxboothError as error:
        outcome = f"`{error.code}`: {error.message[:90]}..."
    written, cpu = bytes_written_by_this_thread() - written, time.thread_time() - cpu
    return f"| {name} | {len(archive) / 1e6:.2f} MB | {outcome} | {written / 1e6:.2f} MB | {cpu:.2f} |"


def attacks(work: Path) -> list[str]:
    member = repeated_deflate(sparse_block(MiB, 700, seed=1), repeats=223)
    repeated = zip_listing_one_member_many_times(member, ["photo.png"] * 19)
    large = flat_png(7000, 7000, (30, 60, 90))
    large_repeated = zip_listing_one_member_many_times(deflated(large), ["big.png"] * 40)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for index in range(40):
            archive.writestr(f"copy{index:02d}.png", large)
    large_copies = buffer.getvalue()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for index in range(12):
            archive.writestr(f"strip{index:02d}.png", flat_png(1000, 49000, (index * 20, 100, 200)))
    strips = buffer.getvalue()
    return [
        "| attack (was) | uploaded | outcome now | written now | CPU s now |",
        "|---|---:|---|---:|---:|",
        run_attack("one member listed 19 times (wrote 4.2 GB)", repeated, work),
        run_attack("one 49 Mpx PNG listed 40 times (25 s CPU)", large_repeated, work),
        run_attack("one 49 Mpx PNG stored as 40 real copies", large_copies, work),
        run_attack("12 strips of 1000x49000 at 1024² (wrote 1.8 GB)", strips, work),
    ]


def photo_like(side: int, seed: int) -> object:
    import numpy
    from PIL import Image, ImageFilter

    generator = numpy.random.default_rng(seed)
    coarse = generator.integers(0, 255, (side // 64, side // 64, 3), dtype=numpy.uint8)
    smooth = Image.fromarray(coarse).resize((side, side), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(4))
    grain = generator.normal(0, 6, (side, side, 3))
    return Image.fromarray(numpy.clip(numpy.asarray(smooth, dtype=numpy.float32) + grain, 0, 255).astype(numpy.uint8))


def median_seconds(action: Callable[[], object]) -> float:
    timings = []
    for _ in range(REPEATS):
        started = time.thread_time()
        action()
        timings.append(time.thread_time() - started)
    return statistics.median(timings)


def png_storage() -> list[str]:
    from PIL import Image

    images = {"photo-like 1024²": photo_like(1024, 0), "flat 1024x4096": Image.new("RGB", (1024, 4096), (200, 80, 40))}
    options = {
        "level 0 (stored)": {"compress_level": 0},
        "level 1": {"compress_level": 1},
        "level 1, Z_RLE (chosen)": {"compress_level": 1, "compress_type": zlib.Z_RLE},
        "level 6 (Pillow's default)": {"compress_level": 6},
    }
    rows = ["| image | PNG setting | save, CPU ms | read, CPU ms | size / raw |", "|---|---|---:|---:|---:|"]
    for image_name, image in images.items():
        raw = image.width * image.height * 3
        for option_name, option in options.items():
            buffer = io.BytesIO()
            image.save(buffer, format="PNG", **option)
            data = buffer.getvalue()
            save = median_seconds(lambda image=image, option=option: image.save(io.BytesIO(), format="PNG", **option))
            read = median_seconds(lambda data=data: Image.open(io.BytesIO(data)).load())
            rows.append(
                f"| {image_name} | {option_name} | {save * 1000:.0f} | {read * 1000:.0f} | {len(data) / raw:.3f} |"
            )
    return rows


def decode_rates() -> list[str]:
    from PIL import Image

    photo = photo_like(4000, 1).resize((4000, 3000))
    rows = ["| format (12 Mpx) | file | decode, CPU s | Mpx per CPU s |", "|---|---:|---:|---:|"]
    for image_format, option in (("JPEG", {"quality": 90}), ("PNG", {"compress_level": 6})):
        buffer = io.BytesIO()
        photo.save(buffer, format=image_format, **option)
        data = buffer.getvalue()
        seconds = median_seconds(lambda data=data: Image.open(io.BytesIO(data)).load())
        rows.append(f"| {image_format} | {len(data) / 1e6:.1f} MB | {seconds:.3f} | {12 / seconds:.0f} |")
    return rows


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        attack_rows = attacks(Path(scratch))
    tables = [
        "## Dataset work budgets (`bench/dataset_budgets.py`)",
        "",
        f"Machine: {platform.machine()}, 2 cores shared with other work, Python {platform.python_version()}; "
        f"CPU time of the preparing thread, medians of {REPEATS} for the storage and decode tables.",
        "",
        "The measured attacks at full size, with today's default budgets ('was': as measured before them):",
        "",
        *attack_rows,
        "",
        "The strips and the large image here are flat colour, so their zips are far smaller than the measured "
        "ones; what is written is bounded by the archive budgets and by the crop, not by what the zip holds.",
        "",
        "Storing the normalised images:",
        "",
        *png_storage(),
        "",
        "Decoding:",
        "",
        *decode_rates(),
    ]
    table = "\n".join(tables)
    print(table)
    write_section(table, name="dataset_budgets")


if __name__ == "__main__":
    main()
