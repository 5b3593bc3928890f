"""Faces with dlib: the HOG frontal detector, the 5-point landmarks, `get_face_chip` alignment and the ResNet
recogniser (128 numbers per face; two faces nearer than 0.6 are the same person by dlib's published threshold).

The weights are the public-domain files that the `face-recognition-models` package ships; they are found
through its installed location without importing it (its __init__ imports pkg_resources, which new setuptools
no longer has) and held to the sha256 pins below. The 68-point landmark model and the CNN (mmod) detector are
never used. Descriptors stay in memory: nothing here writes or logs them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fluxbooth.likeness.inputs import SCORED_SIDE
from fluxbooth.likeness.weights import ModelRecord, ModelUnavailable
from fluxbooth.storage.artifacts import sha256_file

MODELS_PACKAGE = "face_recognition_models"
RECOGNISER_FILE = "dlib_face_recognition_resnet_model_v1.dat"
LANDMARKS_FILE = "shape_predictor_5_face_landmarks.dat"
# sha256 of the two files as face-recognition-models 0.3.0 ships them (computed from the installed package).
FILE_SHA256 = {
    RECOGNISER_FILE: "55533b28a95800a551ba546ba62fe69625c7e95a7061c338adffead08719da30",
    LANDMARKS_FILE: "c4b1e9804792707d3a405c2c16a80a20269e6675021f64a41d30fffafbc41888",
}
LICENCE = "public domain (CC0-1.0), dlib's models as face-recognition-models ships them"
# The chip dlib's recogniser was trained on: 150 px, a quarter of the face's size as margin.
CHIP_SIZE, CHIP_PADDING = 150, 0.25
# HOG finds faces of about 80 px and up; one upsampling halves that, so images under this side are upsampled once.
UPSAMPLE_BELOW_SIDE = 1024
# A detection this confident counts as a face when photos are counted for subject_type "auto"; weaker ones (dlib
# keeps any score above 0) are often not faces: a glove in the astronaut portrait scores 0.12, her face 1.16.
CONFIDENT_FACE_SCORE = 0.5


def models_folder() -> Path:
    """The installed face_recognition_models/models folder, found without importing the package."""
    spec = importlib.util.find_spec(MODELS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(
            f"the {MODELS_PACKAGE} package is not installed: pip install face-recognition-models (the README's set-up)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "models"


def checked_model_file(name: str) -> Path:
    """One of the two weight files, held to its pin."""
    path = models_folder() / name
    if not path.is_file():
        raise ModelUnavailable(f"{path} is missing: reinstall face-recognition-models")
    actual = sha256_file(path)
    if actual != FILE_SHA256[name]:
        raise ModelUnavailable(
            f"{path} has sha256 {actual}, not the pinned {FILE_SHA256[name]}: reinstall face-recognition-models"
        )
    return path


def as_rgb_array(image: Image.Image) -> np.ndarray:
    """A contiguous uint8 RGB array, shrunk to SCORED_SIDE when larger (a face in a large photo is large;
    detection time grows with the pixels). Images read from disk come already shrunk (inputs.load_image)."""
    image = image.convert("RGB")
    if max(image.size) > SCORED_SIDE:
        scale = SCORED_SIDE / max(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.LANCZOS)
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8))


@dataclass
class FaceEmbedder:
    """dlib's detector, aligner and recogniser, loaded once per process."""

    detector: Any
    landmarks: Any
    recogniser: Any
    record: ModelRecord

    def faces(self, pixels: np.ndarray) -> list[tuple[Any, float]]:
        """Every detection with its score, most confident first."""
        upsample = 1 if min(pixels.shape[:2]) < UPSAMPLE_BELOW_SIDE else 0
        rectangles, scores, _ = self.detector.run(pixels, upsample, 0.0)
        return sorted(zip(rectangles, scores, strict=True), key=lambda found: -found[1])

    def count_faces(self, image: Image.Image) -> int:
        """Confident detections only (CONFIDENT_FACE_SCORE)."""
        return sum(score >= CONFIDENT_FACE_SCORE for _, score in self.faces(as_rgb_array(image)))

    def embed(self, image: Image.Image) -> np.ndarray | None:
        """The most confident face's descriptor, aligned on its 5 landmarks; None when dlib finds no face."""
        import dlib  # on use only: the worker's process and the CLI's other commands never load it

        pixels = as_rgb_array(image)
        found = self.faces(pixels)
        if not found:
            return None
        face = found[0][0]
        chip = dlib.get_face_chip(pixels, self.landmarks(pixels, face), size=CHIP_SIZE, padding=CHIP_PADDING)
        return np.asarray(self.recogniser.compute_face_descriptor(chip), dtype=np.float64)


def load_face_embedder() -> FaceEmbedder:
    """dlib's three models, or ModelUnavailable saying what is missing."""
    try:
        import dlib  # on use only: see FaceEmbedder.embed
    except ImportError as error:
        raise ModelUnavailable(
            f"dlib is not installed ({error}): pip install dlib-bin (the README's set-up)"
        ) from error
    recogniser_path = checked_model_file(RECOGNISER_FILE)
    landmarks_path = checked_model_file(LANDMARKS_FILE)
    try:
        version = metadata.version("face-recognition-models")
    except metadata.PackageNotFoundError:
        version = "unknown"
    record = ModelRecord(
        "likeness",
        f"dlib ResNet face recogniser ({RECOGNISER_FILE})",
        f"face-recognition-models {version}",
        FILE_SHA256[RECOGNISER_FILE],
        LICENCE,
        "used",
    )
    return FaceEmbedder(
        dlib.get_frontal_face_detector(),
        dlib.shape_predictor(str(landmarks_path)),
        dlib.face_recognition_model_v1(str(recogniser_path)),
        record,
    )
