"""The dataset check's and the training report's own cost on this machine, and the evidence for the check's
near-duplicate threshold.

1. `check_dataset` on 100 prepared photos (half portraits, half textured scenes; stored as the dataset stage
   stores them, the shorter side at the training size) at 512² and 1024²: wall and CPU seconds, median of 3,
   and where one image's CPU time goes.
2. `make_report` for the demo job's shape (8 steps, 4 images at 64², no validation) and for a larger run
   (1000 steps, 2 prompts x 5 rounds of renders and 100 images, at 1024²): wall seconds and the file sizes.
3. Near-duplicate distances: photos against their re-encodes, resizes and crops, and between distinct photos.

`python bench/dataset_checks.py` prints the tables and rewrites its section of bench/RESULTS.md.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

from bench.overhead import write_section  # noqa: E402
from tests.support.photos import blurred, encoded, portrait, textured_photo  # noqa: E402

PHOTOS = 100
REPEATS = 3


def prepared_photos(folder: Path, side: int) -> list[tuple[str, Path]]:
    """PHOTOS portrait-shaped (3:4) PNGs as the dataset stage stores them at a `side`² training size."""
    import numpy as np
    from PIL import Image, ImageOps

    generator = np.random.default_rng(0)
    size = (side, side * 4 // 3)
    files = []
    for index in range(PHOTOS):
        scene = portrait(index, side=512) if index % 2 else textured_photo(index, (512, 512))
        image = ImageOps.fit(scene, size, Image.Resampling.BICUBIC)
        grain = generator.normal(0, 4, (size[1], size[0], 3))
        image = Image.fromarray(np.clip(np.asarray(image, dtype=np.float32) + grain, 0, 255).astype(np.uint8))
        path = folder / f"photo{index:03d}.png"
        image.save(path, format="PNG", compress_level=1, compress_type=zlib.Z_RLE)
        files.append((f"photo{index:03d}.jpg", path))
    return files


def timed(action: Callable[[], object]) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = action()
    return time.perf_counter() - wall, time.process_time() - cpu, result


def checks_table(scratch: Path) -> list[str]:
    from fluxbooth.dataset.checks import check_dataset

    rows = [
        f"| training size | photos | wall s (median of {REPEATS}) | CPU s | findings |",
        "|---|---:|---:|---:|---:|",
    ]
    for side in (512, 1024):
        folder = scratch / f"checks-{side}"
        folder.mkdir()
        files = prepared_photos(folder, side)
        runs = [
            timed(lambda files=files, side=side: check_dataset(files, lambda w, h: (side, side), "warn"))
            for _ in range(REPEATS)
        ]
        wall = statistics.median(run[0] for run in runs)
        cpu = statistics.median(run[1] for run in runs)
        rows.append(f"| {side}² | {PHOTOS} | {wall:.2f} | {cpu:.2f} | {len(runs[0][2].findings)} |")  # type: ignore[attr-defined]
    return rows + ["", *split_table(scratch / "checks-1024")]


def split_table(folder: Path) -> list[str]:
    """CPU milliseconds per image of each measurement, over the 1024² photos, one thread."""
    from PIL import Image

    from fluxbooth.dataset.checks import FaceCounter, laplacian_variance
    from fluxbooth.dataset.near_duplicates import crop_thumbnails

    count_faces = FaceCounter()
    spent = dict.fromkeys(
        (
            "read and sha256",
            "PNG decode to colour and grey",
            "faces (Haar)",
            "sharpness (Laplacian)",
            "crop thumbnails",
        ),
        0.0,
    )
    paths = sorted(folder.glob("*.png"))[:30]
    for path in paths:
        started = time.thread_time()
        data = path.read_bytes()
        hashlib.sha256(data).hexdigest()
        spent["read and sha256"] += time.thread_time() - started
        started = time.thread_time()
        with Image.open(io.BytesIO(data)) as opened:
            colour = opened.convert("RGB")
        grey = colour.convert("L")
        spent["PNG decode to colour and grey"] += time.thread_time() - started
        for name, measure, image in (
            ("faces (Haar)", count_faces, grey),
            ("sharpness (Laplacian)", laplacian_variance, grey),
            ("crop thumbnails", crop_thumbnails, colour),
        ):
            started = time.thread_time()
            measure(image)
            spent[name] += time.thread_time() - started
    rows = ["| per 1024² photo (one thread) | CPU ms |", "|---|---:|"]
    return rows + [f"| {name} | {seconds / len(paths) * 1000:.1f} |" for name, seconds in spent.items()]


def report_run(
    scratch: Path, name: str, steps: int, rounds: list[int], images: int, side: int
) -> tuple[float, dict[str, int]]:
    from fluxbooth.contract.events import CheckpointEvent, StepEvent
    from fluxbooth.contract.layout import VALIDATION_FOLDER, VALIDATION_INDEX_NAME
    from fluxbooth.report import ReportInputs, SheetImage, make_report

    output = scratch / name / "output"
    folder = output / VALIDATION_FOLDER
    folder.mkdir(parents=True)
    records = []
    for step in [*rounds, steps] if rounds else []:
        subfolder = f"step-{step:06d}/" if step != steps else ""
        (folder / subfolder).mkdir(exist_ok=True)
        for index, prompt in enumerate(("a photo of sks dog", "a sks dog in the snow")):
            file = f"{subfolder}validation_{index:02d}.png"
            textured_photo(step + index, (side, side)).save(folder / file)
            records.append({"file": file, "prompt": prompt, "seed": 0, "steps": 28, "training_step": step})
    if records:
        (folder / VALIDATION_INDEX_NAME).write_text(json.dumps({"images": records}))
    instance = scratch / name / "instance"
    instance.mkdir()
    sheet = []
    for index in range(images):
        path = instance / f"photo{index}.png"
        textured_photo(index, (side, side * 4 // 3)).save(path, compress_level=1)
        sheet.append(SheetImage(f"photo{index}.jpg", path, "a photo of sks dog", ()))
    events = [StepEvent(step, steps, 0.5, 1e-4, 1.0) for step in range(1, steps + 1)] + [
        CheckpointEvent(steps // 2, "c")
    ]
    wall, _, report = timed(lambda: make_report(ReportInputs(name, events, output, sheet, lambda w, h: (side, side))))
    sizes = {path.relative_to(output).as_posix(): path.stat().st_size for path in report.files}  # type: ignore[attr-defined]
    return wall, sizes


def report_table(scratch: Path) -> list[str]:
    rows = ["| run | wall s | files (bytes) |", "|---|---:|---|"]
    runs = (
        ("demo shape: 8 steps, 4 images at 64², no validation", "demo", 8, [], 4, 64),
        (
            "1000 steps, 2 prompts x (4 rounds + final), 100 images, 1024²",
            "large",
            1000,
            [200, 400, 600, 800],
            100,
            1024,
        ),
    )
    for label, name, steps, rounds, images, side in runs:
        wall, sizes = report_run(scratch, name, steps, rounds, images, side)
        files = ", ".join(f"{file.removeprefix('report/')} {size:,}" for file, size in sorted(sizes.items()))
        rows.append(f"| {label} | {wall:.2f} | {files} |")
    return rows


def distance_table() -> list[str]:
    """Near-duplicate distances (`NEAR_DUPLICATE_DISTANCE`): photos against their copies, and distinct photos."""
    import itertools

    from PIL import Image

    from fluxbooth.dataset.near_duplicates import crop_thumbnails, near_duplicate_distances
    from tests.support.photos import SUBJECT_PLACES, subject_photo

    def reopened(data: bytes) -> Image.Image:
        return Image.open(io.BytesIO(data)).convert("RGB")

    def distance(first: Image.Image, second: Image.Image) -> float:
        return float(near_duplicate_distances([crop_thumbnails(first), crop_thumbnails(second)])[0, 1])

    def cut(photo: Image.Image, left: float, top: float, right: float, bottom: float) -> Image.Image:
        width, height = photo.size
        return photo.crop(
            (round(left * width), round(top * height), round((1 - right) * width), round((1 - bottom) * height))
        )

    copies: dict[str, Callable[[Image.Image], Image.Image]] = {
        "JPEG quality 95": lambda photo: reopened(encoded(photo, quality=95)),
        "JPEG quality 40": lambda photo: reopened(encoded(photo, quality=40)),
        "JPEG quality 10": lambda photo: reopened(encoded(photo, quality=10)),
        "halved": lambda photo: photo.resize((photo.width // 2, photo.height // 2)),
        "downscaled to 128 and back": lambda photo: photo.resize((128, 128)).resize(photo.size),
        "blurred (radius 2)": lambda photo: blurred(photo, 2),
        "cropped 10 % off the left": lambda photo: cut(photo, 0.1, 0, 0, 0),
        "cropped 7 % off the right, 3 % off the top": lambda photo: cut(photo, 0, 0.03, 0.07, 0),
        "cropped 5 % off every edge": lambda photo: cut(photo, 0.05, 0.05, 0.05, 0.05),
        "cropped 12 % off the left": lambda photo: cut(photo, 0.12, 0, 0, 0),
        "cropped 20 % off the left": lambda photo: cut(photo, 0.2, 0, 0, 0),
        "mirrored": lambda photo: photo.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
    }
    originals = {
        "portrait": portrait(0, side=512),
        "textured scene": textured_photo(0, (512, 512)),
        "studio shot": subject_photo(0, 0, (512, 512)),
    }
    rows = ["| copy | " + " | ".join(originals) + " |", "|---|" + "---:|" * len(originals)]
    for name, copy in copies.items():
        rows.append(
            f"| {name} | " + " | ".join(f"{distance(photo, copy(photo)):.3f}" for photo in originals.values()) + " |"
        )

    def spread(label: str, photos: list[Image.Image]) -> str:
        matrix = near_duplicate_distances([crop_thumbnails(photo) for photo in photos])
        pairs = sorted(float(matrix[a, b]) for a, b in itertools.combinations(range(len(photos)), 2))
        return f"| {label} | {pairs[0]:.3f} | {statistics.median(pairs):.3f} |"

    places = range(len(SUBJECT_PLACES))
    rows += ["", "| distinct photos, each pair | smallest | median |", "|---|---:|---:|"]
    rows += [
        spread("the portrait's three framings", [portrait(index, side=512) for index in range(3)]),
        spread("30 textured scenes", [textured_photo(seed, (512, 512)) for seed in range(30)]),
        spread("the toy on 6 backgrounds in 6 places", [subject_photo(index, index, (512, 512)) for index in places]),
        spread("the toy in 6 places, one background", [subject_photo(0, place, (512, 512)) for place in places]),
        spread("the toy in one place, 6 backgrounds", [subject_photo(index, 5, (512, 512)) for index in places]),
        spread(
            "a small toy (15 %), 6 backgrounds and places",
            [subject_photo(index, index, (512, 512), share=0.15) for index in places],
        ),
    ]
    return rows


def sharpness_table() -> list[str]:
    """Variance of the Laplacian of edits of the portrait, as a share of the portrait's own (`BLUR_SHARE`)."""
    from PIL import Image

    from fluxbooth.dataset.checks import laplacian_variance

    photo = portrait(0, side=512)
    own = laplacian_variance(photo.convert("L"))
    variants = {
        "JPEG quality 40": Image.open(io.BytesIO(encoded(photo, quality=40))),
        "Gaussian blur, radius 0.5 px": blurred(photo, 0.5),
        "Gaussian blur, radius 1 px": blurred(photo, 1),
        "Gaussian blur, radius 2 px": blurred(photo, 2),
        "a sharp textured scene with smooth areas": textured_photo(7, (512, 512)),
    }
    rows = [f"| against the portrait at 512² (variance {own:.0f}) | share of its sharpness |", "|---|---:|"]
    return rows + [
        f"| {name} | {laplacian_variance(image.convert('L')) / own:.3f} |" for name, image in variants.items()
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        checks = checks_table(Path(scratch))
        report = report_table(Path(scratch))
    lines = [
        "## Dataset check and training report (`bench/dataset_checks.py`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores shared with other engineers' jobs and tests (load average {os.getloadavg()[0]:.1f} at the end) while "
        f"it ran (numbers under contention), Python {platform.python_version()}.",
        "",
        f"The dataset check on {PHOTOS} prepared photos (3:4, half portraits with one face, half textured scenes):",
        "",
        *checks,
        "",
        "The report, made after training:",
        "",
        *report,
        "",
        "The near-duplicate threshold (`NEAR_DUPLICATE_DISTANCE`): copies of a photo against distinct photos:",
        "",
        *distance_table(),
        "",
        "The blur threshold (`BLUR_SHARE` of the set's median):",
        "",
        *sharpness_table(),
    ]
    table = "\n".join(lines)
    print(table)
    write_section(table, "dataset_checks")


if __name__ == "__main__":
    main()
