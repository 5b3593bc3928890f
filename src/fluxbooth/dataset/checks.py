"""The dataset check: what in the photos silently ruins a run, found before any GPU time is spent.

Each instance image is measured as the trainer will read it (the prepared file, after orientation and the
aspect cap), once, in `measure_image`; `assess` (pure) turns the measurements into findings:
- duplicates: identical pixels, or the same photo re-encoded, resized or cropped (near_duplicates.py: small
  colour thumbnails of the image and of its crops, so that another photo of the subject does not match);
- blurry images: the variance of the Laplacian (the standard sharpness measure) below BLUR_SHARE of the set's
  median, or below BLUR_FLOOR whatever the set, measured at no more than SHARPNESS_SIDE pixels on the
  shorter side so that sizes compare;
- too small: an image the trainer must upscale to cover the training size;
- extreme aspect ratios: more than EXTREME_ASPECT:1 either way, which a fixed training shape crops to a
  fraction and aspect buckets train in a bucket of its own;
- faces: OpenCV's bundled Haar cascade counts frontal faces in every image. Whether the subject is a person
  is read from the photos themselves, not the prompt (prompts are free text in any language): when most
  images show one face or more, an image with none or with several is flagged, since a DreamBooth subject
  must be the one face in every photo; a set where most images show no face (a dog, a product) gets no face
  flags. The counts are always reported.

`dataset_checks: "warn"` puts the findings in the result's warnings; `"strict"` refuses the job
(`invalid_dataset`) naming the files and the reasons. Class images are not checked: they are generic on
purpose. Torch-free (numpy, Pillow and OpenCV); bench/dataset_checks.py measures its time.
"""

from __future__ import annotations

import hashlib
import io
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from PIL import Image

from fluxbooth.dataset.near_duplicates import NEAR_DUPLICATE_DISTANCE, crop_thumbnails, near_duplicate_distances
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import bounded_list, short_name
from fluxbooth.request.limits import DatasetCheckMode

if TYPE_CHECKING:
    from fluxbooth.dataset import PreparedDataset

# The shape an image of (width, height) trains at: the request's fixed shape, or its largest bucket.
TrainingShape = Callable[[int, int], tuple[int, int]]

SHARPNESS_SIDE = 512
# Of the set's median sharpness (with BLUR_MIN_SET images or more). bench/dataset_checks.py, against a portrait at 512²:
# a Gaussian blur of 1 px leaves 0.08 of its sharpness, 2 px 0.01; JPEG quality 40 keeps 0.87, and a sharp scene with
# smooth areas measures 0.28 of it.
BLUR_SHARE = 0.1
BLUR_MIN_SET = 3
BLUR_FLOOR = 25.0  # a photo this soft at SHARPNESS_SIDE is blurry in any set
EXTREME_ASPECT = 2.0
FACE_SIDE = 320  # faces of a portrait set are large: detected on the longer side scaled to this
FACE_MIN_SHARE = 0.08  # of the shorter side: smaller detections are texture, not a subject's face
FACE_CASCADE = "haarcascade_frontalface_default.xml"
FACE_SCALE_STEP = 1.2  # between detection scales; 1.1 took 1.7x the time on 320 px portraits here, same faces
FACE_MIN_NEIGHBOURS = 5  # overlapping detections a face needs: fewer lets texture pass for faces
FACE_MIN_PIXELS = 24  # the cascade's own window
# What a message names: files per finding, findings per check (or per refusal), and the characters of each.
MAX_FILES_NAMED = 8
MAX_FILES_CHARS = 1200
MAX_FINDINGS_NAMED = 10
MAX_LINE_CHARS = 2000
CHECK_THREADS = 2  # OpenCV and Pillow release the GIL; the worker's CPUs are otherwise idle during this stage

CheckName = Literal["duplicate", "near_duplicate", "blurry", "too_small", "aspect_ratio", "no_face", "several_faces"]
CHECK_ADVICE: dict[CheckName, str] = {
    "duplicate": "the same photo more than once: keep one",
    "near_duplicate": "the same photo re-encoded, resized or cropped: keep one",
    "blurry": "blurry: the model learns the blur; replace it with a sharp photo",
    "too_small": "smaller than the training size: it is upscaled and trains soft",
    "aspect_ratio": f"more than {EXTREME_ASPECT:g}:1: the crop to the training shape loses much of it, or it trains in a bucket of its own",
    "no_face": "no face found while most photos show one: the subject may be missing",
    "several_faces": "several faces: the model cannot tell which one is the subject",
}


@dataclass(frozen=True)
class ImageMeasures:
    """What the checks need of one image; `name` is the file as uploaded."""

    name: str
    width: int
    height: int
    pixel_digest: str
    thumbnails: np.ndarray = field(compare=False, repr=False)  # near_duplicates.crop_thumbnails
    sharpness: float
    faces: int | None  # None when no face detector could run


@dataclass(frozen=True)
class Finding:
    check: CheckName
    files: tuple[str, ...]
    detail: str

    @property
    def shown_files(self) -> list[str]:
        """The files as a message names them: each name shortened, the first MAX_FILES_NAMED, then a count."""
        return bounded_list([short_name(name) for name in self.files], MAX_FILES_NAMED, MAX_FILES_CHARS)

    @property
    def message(self) -> str:
        return f"{', '.join(self.shown_files)}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check, "files": self.shown_files, "file_count": len(self.files), "message": self.message}


@dataclass(frozen=True)
class DatasetChecks:
    mode: DatasetCheckMode
    images: tuple[ImageMeasures, ...]
    findings: tuple[Finding, ...]
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())

    def flags(self) -> dict[str, list[CheckName]]:
        """The checks each file failed, for the report's contact sheet."""
        flagged: dict[str, list[CheckName]] = {}
        for finding in self.findings:
            for name in finding.files:
                flagged.setdefault(name, []).append(finding.check)
        return flagged

    def warnings(self) -> list[str]:
        """One line per check that found something, every file named."""
        lines = []
        for check, advice in CHECK_ADVICE.items():
            found = [finding.message for finding in self.findings if finding.check == check]
            if found:
                lines.append(
                    f"dataset check, {advice}: "
                    + "; ".join(bounded_list(found, MAX_FINDINGS_NAMED, MAX_LINE_CHARS, MAX_FILES_CHARS + 200))
                )
        return lines + list(self.notes)

    def faces_by_file(self) -> dict[str, int | None]:
        return {image.name: image.faces for image in self.images}

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "images": len(self.images),
            "seconds": round(self.seconds, 3),
            "findings": [finding.to_dict() for finding in self.findings],
            "faces": self.faces_by_file(),
            "sharpness": {image.name: round(image.sharpness, 1) for image in self.images},
            "notes": list(self.notes),
        }


def _scaled(grey: Image.Image, side: int, *, longer: bool) -> Image.Image:
    reference = max(grey.size) if longer else min(grey.size)
    if reference <= side:
        return grey
    scale = side / reference
    return grey.resize((max(1, round(grey.width * scale)), max(1, round(grey.height * scale))), Image.Resampling.BOX)


def laplacian_variance(grey: Image.Image) -> float:
    import cv2  # deferred: OpenCV is heavy to import, and only the dataset checks need it

    return float(cv2.Laplacian(np.asarray(_scaled(grey, SHARPNESS_SIDE, longer=False)), cv2.CV_64F).var())


class FaceCounter:
    """OpenCV's bundled frontal-face Haar cascade; one per thread (a cascade is not safe to share)."""

    def __init__(self) -> None:
        import cv2.data  # deferred, as in laplacian_variance; cv2.data named: the stubs leave the submodule out

        self._file = str(Path(cv2.data.haarcascades) / FACE_CASCADE)
        self._local = threading.local()
        self._cascade()  # a missing or broken file fails here, once

    def _cascade(self) -> Any:
        cascade = getattr(self._local, "cascade", None)
        if cascade is None:
            import cv2  # deferred, as in laplacian_variance

            cascade = cv2.CascadeClassifier(self._file)
            if cascade.empty():
                raise RuntimeError(f"OpenCV's {FACE_CASCADE} could not be loaded")
            self._local.cascade = cascade
        return cascade

    def __call__(self, grey: Image.Image) -> int:
        small = np.asarray(_scaled(grey, FACE_SIDE, longer=True))
        smallest = max(FACE_MIN_PIXELS, round(FACE_MIN_SHARE * min(small.shape)))
        found = self._cascade().detectMultiScale(
            small, scaleFactor=FACE_SCALE_STEP, minNeighbors=FACE_MIN_NEIGHBOURS, minSize=(smallest, smallest)
        )
        return len(found)


def measure_image(name: str, path: Path, count_faces: Callable[[Image.Image], int] | None) -> ImageMeasures:
    """One prepared file's measurements. Its bytes stand for its pixels: the dataset stage writes every
    image with one encoder and settings, so identical pixels make identical files."""
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as opened:
        colour = opened.convert("RGB")
    grey = colour.convert("L")
    return ImageMeasures(
        name=name,
        width=grey.width,
        height=grey.height,
        pixel_digest=hashlib.sha256(data).hexdigest(),
        thumbnails=crop_thumbnails(colour),
        sharpness=laplacian_variance(grey),
        faces=count_faces(grey) if count_faces is not None else None,
    )


def _groups(count: int, pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
    """Indices linked by `pairs`, transitively: the groups of two or more, each in upload order."""
    parent = list(range(count))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for first, second in pairs:
        parent[max(root(first), root(second))] = min(root(first), root(second))
    members: dict[int, list[int]] = {}
    for index in range(count):
        members.setdefault(root(index), []).append(index)
    return [group for group in members.values() if len(group) > 1]


def _duplicate_findings(images: Sequence[ImageMeasures]) -> list[Finding]:
    findings = []
    by_digest: dict[str, list[int]] = {}
    for index, image in enumerate(images):
        by_digest.setdefault(image.pixel_digest, []).append(index)
    exact = [group for group in by_digest.values() if len(group) > 1]
    for group in exact:
        findings.append(Finding("duplicate", tuple(images[i].name for i in group), "identical pixels"))
    distances = near_duplicate_distances([image.thumbnails for image in images])
    near = zip(*np.nonzero(np.triu(distances <= NEAR_DUPLICATE_DISTANCE, k=1)), strict=True)
    for group in _groups(len(images), ((int(a), int(b)) for a, b in near)):
        if any(set(group) <= set(same) for same in exact):
            continue  # only exact copies of each other: already said
        closest = max(min(float(distances[a, b]) for b in group if b != a) for a in group)
        findings.append(
            Finding(
                "near_duplicate",
                tuple(images[i].name for i in group),
                f"each matches another's pixels or a crop of them within {closest:.2f} (the limit is {NEAR_DUPLICATE_DISTANCE:g})",
            )
        )
    return findings


def _blur_findings(images: Sequence[ImageMeasures]) -> list[Finding]:
    median = statistics.median(image.sharpness for image in images) if images else 0.0
    threshold = max(BLUR_FLOOR, BLUR_SHARE * median) if len(images) >= BLUR_MIN_SET else BLUR_FLOOR
    return [
        Finding(
            "blurry",
            (image.name,),
            f"sharpness {image.sharpness:.0f}, below {threshold:.0f} (the set's median is {median:.0f})",
        )
        for image in images
        if image.sharpness < threshold
    ]


def _size_findings(images: Sequence[ImageMeasures], training_shape: TrainingShape) -> list[Finding]:
    findings = []
    for image in images:
        width, height = training_shape(image.width, image.height)
        upscale = max(width / image.width, height / image.height)
        if upscale > 1:
            findings.append(
                Finding(
                    "too_small",
                    (image.name,),
                    f"{image.width}x{image.height}, upscaled {upscale:.1f}x to cover {width}x{height}",
                )
            )
        aspect = max(image.width / image.height, image.height / image.width)
        if aspect > EXTREME_ASPECT:
            stretch = (image.width / image.height) / (width / height)
            kept = 100 / max(stretch, 1 / stretch)
            findings.append(
                Finding(
                    "aspect_ratio",
                    (image.name,),
                    f"{aspect:.1f}:1 ({image.width}x{image.height}), trained at {width}x{height} from {kept:.0f} % of it",
                )
            )
    return findings


def _face_findings(images: Sequence[ImageMeasures]) -> list[Finding]:
    counted = [image for image in images if image.faces is not None]
    with_faces = sum(1 for image in counted if image.faces)
    if not counted or with_faces * 2 <= len(counted):
        return []
    findings = [Finding("no_face", (image.name,), "0 faces") for image in counted if image.faces == 0]
    findings += [
        Finding("several_faces", (image.name,), f"{image.faces} faces") for image in counted if (image.faces or 0) > 1
    ]
    return findings


def assess(images: Sequence[ImageMeasures], training_shape: TrainingShape) -> list[Finding]:
    """Every finding about a measured set, in CHECK_ADVICE order."""
    findings = (
        _duplicate_findings(images)
        + _blur_findings(images)
        + _size_findings(images, training_shape)
        + _face_findings(images)
    )
    order = list(CHECK_ADVICE)
    return sorted(findings, key=lambda finding: order.index(finding.check))


def _face_counter() -> tuple[FaceCounter | None, tuple[str, ...]]:
    try:
        return FaceCounter(), ()
    except (ImportError, RuntimeError, AttributeError) as error:
        return None, (f"dataset check: faces were not counted ({error})",)


def check_dataset(
    files: Sequence[tuple[str, Path]],
    training_shape: TrainingShape,
    mode: DatasetCheckMode,
    *,
    on_image: Callable[[int, int], None] | None = None,
) -> DatasetChecks:
    """Measure each (uploaded name, prepared file) and assess the set; `on_image(done, total)` after each."""
    started = time.monotonic()
    count_faces, notes = _face_counter()
    measured: list[ImageMeasures] = []
    with ThreadPoolExecutor(max_workers=CHECK_THREADS) as pool:
        for measures in pool.map(lambda item: measure_image(item[0], item[1], count_faces), files):
            measured.append(measures)
            if on_image is not None:
                on_image(len(measured), len(files))
    findings = assess(measured, training_shape)
    return DatasetChecks(mode, tuple(measured), tuple(findings), time.monotonic() - started, notes)


def check_prepared(
    dataset: PreparedDataset,
    training_shape: TrainingShape,
    mode: DatasetCheckMode,
    *,
    on_image: Callable[[int, int], None] | None = None,
) -> DatasetChecks:
    """The prepared instance images, in upload order, each named as uploaded."""
    files = [(uploaded, dataset.instance_dir / prepared) for prepared, uploaded in dataset.uploaded_names.items()]
    return check_dataset(files, training_shape, mode, on_image=on_image)


def enforce(checks: DatasetChecks) -> None:
    """Under `strict`, any finding refuses the job, naming every file and its reason."""
    if checks.mode != "strict" or not checks.findings:
        return
    reasons = bounded_list(
        [f"{finding.message} ({CHECK_ADVICE[finding.check]})" for finding in checks.findings],
        MAX_FINDINGS_NAMED,
        MAX_LINE_CHARS,
        MAX_FILES_CHARS + 400,
    )
    files = {name for finding in checks.findings for name in finding.files}
    raise FluxboothError(
        ErrorCode.INVALID_DATASET,
        f"dataset: dataset_checks is strict and {len(files)} file(s) failed the dataset check: {'; '.join(reasons)}. "
        'Remove or replace them, or set dataset_checks to "warn"',
        details={
            "findings": [finding.to_dict() for finding in checks.findings[:MAX_FINDINGS_NAMED]],
            "finding_count": len(checks.findings),
        },
    )
