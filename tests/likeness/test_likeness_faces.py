"""Real weights for faces: dlib's detector, 5-point aligner and ResNet recogniser (the public-domain files of
face-recognition-models) on two public-domain portraits that ship inside PyPI packages, scikit-image's
astronaut (Eileen Collins) and matplotlib's Grace Hopper, each under realistic changes.

The augmented views of one portrait are NOT independent photos of that person: they share the pose, light and
expression, so these tests show the pipeline works end to end on real faces, not how well it tells people apart
in general (dlib reports 99.38% on LFW for that)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from fluxbooth.cli import main
from fluxbooth.likeness.faces import FaceEmbedder, load_face_embedder
from fluxbooth.likeness.selection import DLIB_MATCH_DISTANCE
from tests.support.likeness_fixtures import (
    CHANGES,
    astronaut,
    cat,
    coffee,
    grace_hopper,
    offline_environ,
    save_all,
    views,
)

PEOPLE = {"astronaut": astronaut, "grace_hopper": grace_hopper}
# Measured with these weights: every view keeps dlib's 0.6 threshold to its own person's centroid (the 8 degree
# rotation included), and no view of the other person comes within it.
VIEWS_WITHIN_THRESHOLD = {"astronaut": set(CHANGES), "grace_hopper": set(CHANGES)}


@pytest.fixture(scope="module")
def faces() -> FaceEmbedder:
    return load_face_embedder()


@pytest.fixture(scope="module")
def descriptors(faces: FaceEmbedder) -> dict[str, dict[str, np.ndarray]]:
    found: dict[str, dict[str, np.ndarray]] = {}
    for person, portrait in PEOPLE.items():
        for change, image in views(portrait()).items():
            descriptor = faces.embed(image)
            assert descriptor is not None, f"dlib found no face in {person}'s {change} view"
            found.setdefault(person, {})[change] = descriptor
    return found


def distances_to_centroid(descriptors: dict[str, dict[str, np.ndarray]], person: str, other: str) -> dict[str, float]:
    centre = np.mean(list(descriptors[person].values()), axis=0)
    return {change: float(np.linalg.norm(vector - centre)) for change, vector in descriptors[other].items()}


@pytest.mark.parametrize("person,other", [("astronaut", "grace_hopper"), ("grace_hopper", "astronaut")])
def test_every_view_of_a_person_is_closer_to_their_centroid_than_any_view_of_the_other(
    descriptors: dict, person: str, other: str
) -> None:
    own = distances_to_centroid(descriptors, person, person)
    theirs = distances_to_centroid(descriptors, person, other)
    assert max(own.values()) < min(theirs.values()), (own, theirs)


@pytest.mark.parametrize("person,other", [("astronaut", "grace_hopper"), ("grace_hopper", "astronaut")])
def test_which_views_keep_dlibs_same_person_threshold(descriptors: dict, person: str, other: str) -> None:
    own = distances_to_centroid(descriptors, person, person)
    theirs = distances_to_centroid(descriptors, person, other)
    assert {change for change, distance in own.items() if distance < DLIB_MATCH_DISTANCE} == VIEWS_WITHIN_THRESHOLD[
        person
    ]
    assert {change for change, distance in theirs.items() if distance < DLIB_MATCH_DISTANCE} == set()


@pytest.mark.parametrize("image", [cat, coffee], ids=["cat", "coffee"])
def test_the_cat_and_the_coffee_hold_no_face(faces: FaceEmbedder, image) -> None:
    assert faces.embed(image()) is None and faces.count_faces(image()) == 0


def test_a_64_pixel_render_holds_no_face(faces: FaceEmbedder) -> None:
    assert faces.embed(astronaut().resize((64, 64))) is None


def test_each_portrait_counts_as_exactly_one_face(faces: FaceEmbedder) -> None:
    # The astronaut's glove is a weak second detection (score 0.12): not counted as a face.
    assert [faces.count_faces(portrait()) for portrait in PEOPLE.values()] == [1, 1]


def score(tmp_path: Path, *arguments: str) -> tuple[int, dict]:
    out = io.StringIO()
    code = main(["score", *arguments], environ=offline_environ(tmp_path), out=out)
    return code, json.loads(out.getvalue())


@pytest.fixture
def astronaut_photos(tmp_path: Path) -> Path:
    images = views(astronaut(), ("original", "crop_and_scale", "colour_shift", "new_background"))
    save_all(list(images.values()), tmp_path / "photos", "photo")
    return tmp_path / "photos"


def test_score_ranks_one_portraits_variants_above_the_others_against_the_first_ones_photos(
    tmp_path: Path, astronaut_photos: Path
) -> None:
    held_out = ("rotation", "jpeg", "flip")
    save_all(list(views(astronaut(), held_out).values()), tmp_path / "same")
    save_all(list(views(grace_hopper(), held_out).values()), tmp_path / "other")
    same_code, same = score(tmp_path, "--photos", str(astronaut_photos), "--renders", str(tmp_path / "same"))
    other_code, other = score(tmp_path, "--photos", str(astronaut_photos), "--renders", str(tmp_path / "other"))
    assert (same_code, other_code) == (0, 0)
    assert same["likeness"] > other["likeness"]
    assert (same["face_detect_rate"], other["face_detect_rate"]) == (1.0, 1.0)
    assert (same["face_match_rate"], other["face_match_rate"]) == (1.0, 0.0)
    assert (
        same["subject_type"] == "person" and same["subject_type_source"] == "auto: 4 of 4 photos hold exactly one face"
    )
    assert same["calibration"]["zero_source"].startswith("no base renders: dlib's same-person boundary")
    assert same["prompt_fidelity"] is None and same["copies"] == 0


def test_score_flags_an_unchanged_copy_of_a_training_photo(tmp_path: Path, astronaut_photos: Path) -> None:
    renders = [astronaut(), *views(astronaut(), ("rotation", "flip")).values()]  # the first is the photo itself
    save_all(renders, tmp_path / "renders")
    code, result = score(tmp_path, "--photos", str(astronaut_photos), "--renders", str(tmp_path / "renders"))
    assert code == 0 and result["copies"] == 1


def test_score_with_base_renders_takes_its_zero_from_them(tmp_path: Path, astronaut_photos: Path) -> None:
    save_all(list(views(astronaut(), ("rotation", "flip")).values()), tmp_path / "renders")
    save_all([grace_hopper(), cat()], tmp_path / "base")
    code, result = score(
        tmp_path,
        "--photos",
        str(astronaut_photos),
        "--renders",
        str(tmp_path / "renders"),
        "--base-renders",
        str(tmp_path / "base"),
        "--subject-type",
        "person",
    )
    assert code == 0 and result["calibration"]["zero_source"] == "the base model's renders at step 0"
    assert result["base_renders"]["likeness"] == 0.0 and result["base_renders"]["face_detect_rate"] == 0.5
    assert result["subject_type_source"] == "request"


def test_score_refuses_a_missing_folder_naming_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["score", "--photos", str(tmp_path / "nowhere"), "--renders", str(tmp_path)], environ={}, out=io.StringIO()
    )
    assert code == 2
    assert (
        capsys.readouterr().err
        == f"error (invalid_input): --photos: {tmp_path / 'nowhere'} is not a folder; give a folder of images\n"
    )
