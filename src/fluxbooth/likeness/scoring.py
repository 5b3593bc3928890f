"""The scoring process: photos and renders in, the likeness section out (the I/O shell around selection.py).

Which models: persons by dlib's face recogniser, pets and objects by DINOv2 (likeness); DINOv2 on whole renders
for variety, whatever the subject; SigLIP for prompt fidelity. The likeness model is needed (without it the
section is `unavailable`); the other two are optional (their numbers are then null and their guards not applied).

The deadline: step 0 and the final step are always scored (the least a section can say); the other steps,
newest first, only while the time left exceeds the longest step scored so far. Embeddings stay in memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from fluxbooth.contract.budgets import MAX_SCORED_PHOTOS
from fluxbooth.contract.scoring import BASE_STEP, PROXY_NOTE, ScoringInput
from fluxbooth.dataset.members import IMAGE_EXTENSIONS
from fluxbooth.likeness.embedders import DinoEmbedder, SiglipScorer, load_dino, load_siglip
from fluxbooth.likeness.faces import FaceEmbedder, load_face_embedder
from fluxbooth.likeness.inputs import (
    MAX_NAMED_UNSCORED,
    NothingToScore,
    RenderSet,
    folder_set,
    image_files,
    load_image,
    unscored_files,
    validation_sets,
)
from fluxbooth.likeness.selection import DLIB_MATCH_DISTANCE, Metric, StepEmbeddings, score_steps
from fluxbooth.likeness.weights import (
    DINO,
    SIGLIP,
    HubModel,
    ModelRecord,
    ModelUnavailable,
    resolve_weights,
    unavailable_record,
)

# The scale's zero when no base renders were made (the `score` command without --base-renders): for faces, dlib's
# published same-person boundary; for images, a cosine of 0 (an unrelated direction).
FACE_FALLBACK_ZERO = (
    1.0 - DLIB_MATCH_DISTANCE,
    "no base renders: dlib's same-person boundary (distance 0.6), so 0 = just not the same person",
)
IMAGE_FALLBACK_ZERO = (0.0, "no base renders: cosine similarity 0, so 0 = no likeness at all (a lenient zero)")
UNSCORED_REASON = "the job's deadline: step 0 and the final step come first, then the newest steps while time was left"


@dataclass
class Scorers:
    """The loaded models for one subject type, and each model's record for the section."""

    subject_type: str
    subject_type_source: str
    faces: FaceEmbedder | None = None
    dino: DinoEmbedder | None = None
    siglip: SiglipScorer | None = None
    records: list[ModelRecord] = field(default_factory=list)

    @property
    def metric(self) -> Metric:
        return "euclidean" if self.subject_type == "person" else "cosine"

    @property
    def fallback_zero(self) -> tuple[float, str]:
        return FACE_FALLBACK_ZERO if self.subject_type == "person" else IMAGE_FALLBACK_ZERO

    def likeness(self, images: Sequence[Image.Image]) -> list[np.ndarray | None]:
        if self.faces is not None:
            return [self.faces.embed(image) for image in images]
        assert self.dino is not None  # load_scorers refuses a subject without its likeness model
        return list(self.dino.embed(images))


def _try_face_embedder() -> tuple[FaceEmbedder | None, str | None]:
    try:
        return load_face_embedder(), None
    except ModelUnavailable as error:
        return None, str(error)


def decide_subject_type(
    requested: str, photos: Sequence[Image.Image], faces: FaceEmbedder | None, why_no_faces: str | None
) -> tuple[str, str]:
    """The subject type and where it came from: the request, or (auto) the photos' faces."""
    if requested != "auto":
        return requested, "request"
    if faces is None:
        return "object", f"auto: faces cannot be counted ({why_no_faces}), so scored as an object"
    single = sum(faces.count_faces(photo) == 1 for photo in photos)
    subject = "person" if single * 2 > len(photos) else "object"
    return subject, f"auto: {single} of {len(photos)} photos hold exactly one face"


def _optional(
    model: HubModel, environ: Mapping[str, str], role: str, loader: Callable[[Path], Any]
) -> tuple[Any, ModelRecord]:
    try:
        weights = resolve_weights(model, environ, role)
        return loader(weights.folder), weights.record
    except ModelUnavailable as error:
        return None, unavailable_record(model, str(error), role)
    except Exception as error:  # a folder the loader cannot read: the model is unavailable, scoring goes on
        return None, unavailable_record(
            model, f"{model.repo_id} could not be loaded ({type(error).__name__}: {error})", role
        )


def load_scorers(
    requested: str, photos: Sequence[Image.Image], environ: Mapping[str, str], with_fidelity: bool
) -> Scorers:
    """The models for this subject; ModelUnavailable when its likeness model is missing."""
    faces, why_no_faces = _try_face_embedder() if requested in ("person", "auto") else (None, None)
    subject, source = decide_subject_type(requested, photos, faces, why_no_faces)
    scorers = Scorers(subject, source)
    if subject == "person":
        if faces is None:
            raise ModelUnavailable(
                f"persons are scored by dlib's face recogniser, which is unavailable: {why_no_faces}"
            )
        scorers.faces = faces
        scorers.records.append(faces.record)
    scorers.dino, dino_record = _optional(DINO, environ, "likeness" if subject != "person" else "variety", load_dino)
    if subject != "person" and scorers.dino is None:
        raise ModelUnavailable(f"{subject}s are scored by DINOv2, which is unavailable: {dino_record.reason}")
    scorers.records.append(dino_record)
    if with_fidelity:
        scorers.siglip, siglip_record = _optional(SIGLIP, environ, "prompt_fidelity", load_siglip)
        scorers.records.append(siglip_record)
    return scorers


def embed_photos(scorers: Scorers, photos: Sequence[Image.Image]) -> np.ndarray:
    vectors = [vector for vector in scorers.likeness(photos) if vector is not None]
    if not vectors:
        raise NothingToScore("no training photo holds a face dlib can find: set subject_type to pet or object")
    return np.stack(vectors)


def embed_step(scorers: Scorers, renders: RenderSet) -> StepEmbeddings:
    """The step's likeness embeddings, SigLIP logits (renders with a prompt) and DINOv2 embeddings for variety."""
    images = [load_image(path) for path in renders.images]
    fidelity = None
    if scorers.siglip is not None and images and all(prompt is not None for prompt in renders.prompts):
        fidelity = tuple(scorers.siglip.logits(images, [str(prompt) for prompt in renders.prompts]))
    variety = scorers.dino.embed(images) if scorers.dino is not None else None
    if scorers.faces is None and variety is not None:
        return StepEmbeddings(renders.step, tuple(variety), fidelity, variety)
    return StepEmbeddings(renders.step, tuple(scorers.likeness(images)), fidelity, variety)


def scoring_order(steps: Sequence[int], final_step: int) -> list[int]:
    """Step 0 and the final step first, then the others newest first."""
    first = [step for step in (BASE_STEP, final_step) if step in steps]
    return first + sorted((step for step in steps if step not in first), reverse=True)


def embed_steps(
    scorers: Scorers,
    sets: Sequence[RenderSet],
    final_step: int,
    stop_at: float | None,
    clock: Callable[[], float] = time.time,
) -> tuple[list[StepEmbeddings], dict[int, int]]:
    """Every step's embeddings the deadline allows, and the skipped steps with their render counts."""
    by_step = {renders.step: renders for renders in sets}
    done: list[StepEmbeddings] = []
    skipped: dict[int, int] = {}
    longest = 0.0
    for step in scoring_order(list(by_step), final_step):
        must = step in (BASE_STEP, final_step)
        if not must and stop_at is not None and clock() + longest > stop_at:
            skipped[step] = len(by_step[step].images)
            continue
        started = clock()
        done.append(embed_step(scorers, by_step[step]))
        longest = max(longest, clock() - started)
    return done, skipped


def scored_section(
    scorers: Scorers, photos: np.ndarray, steps: Sequence[StepEmbeddings], skipped: dict[int, int], keep_best_step: bool
) -> dict[str, Any]:
    """The section (status "scored") from the embeddings."""
    scored = score_steps(
        scorers.metric,
        photos,
        steps,
        faces=scorers.subject_type == "person",
        keep_best_step=keep_best_step,
        fallback_zero=scorers.fallback_zero,
        unscored=skipped,
    )
    return {
        "status": "scored",
        "subject_type": scorers.subject_type,
        "subject_type_source": scorers.subject_type_source,
        "models": [record.to_json() for record in scorers.records],
        "calibration": scored.calibration.to_json(),
        "steps": scored.steps,
        "selected_step": scored.choice.step,
        "selection": scored.choice.sentence,
        "unscored_steps": sorted(skipped),
        "unscored_reason": UNSCORED_REASON if skipped else None,
        "note": PROXY_NOTE,
    }


def evenly_spread(files: Sequence[Path], most: int) -> list[Path]:
    """At most `most` of `files`, spread evenly from the first to the last."""
    if len(files) <= most:
        return list(files)
    return [files[index * len(files) // most] for index in range(most)]


def load_photos(folder: Path) -> list[Image.Image]:
    files = image_files(folder)
    if not files:
        raise NothingToScore(f"{folder} holds no training photos")
    return [load_image(path) for path in evenly_spread(files, MAX_SCORED_PHOTOS)]


def score_job(scoring_input: ScoringInput, clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """The scoring process's work: the section for one job (exceptions are the caller's to turn `unavailable`)."""
    sets = validation_sets(Path(scoring_input.validation_dir), scoring_input.fidelity_prompts)
    photos = load_photos(Path(scoring_input.photos_dir))
    scorers = load_scorers(scoring_input.subject_type, photos, scoring_input.environ, with_fidelity=True)
    photo_embeddings = embed_photos(scorers, photos)
    steps, skipped = embed_steps(scorers, sets, scoring_input.final_step, scoring_input.stop_at_unix_seconds, clock)
    return scored_section(scorers, photo_embeddings, steps, skipped, scoring_input.keep_best_step)


# The `score` command's one set of renders, and its base renders (when given) as the base model's step.
FOLDER_RENDERS_STEP = 1
SUMMARY_KEYS = (
    "renders",
    "likeness",
    "likeness_se",
    "face_detect_rate",
    "face_match_rate",
    "copies",
    "prompt_fidelity",
    "prompt_fidelity_change",
    "variety",
)


def score_folders(
    photos_dir: Path,
    renders_dir: Path,
    base_dir: Path | None,
    subject_type: str,
    prompt: str | None,
    environ: Mapping[str, str],
) -> dict[str, Any]:
    """The `score` command: one folder of renders against the photos, with an optional folder of base renders."""
    sets = [folder_set(FOLDER_RENDERS_STEP, renders_dir, prompt)]
    if base_dir is not None:
        sets.insert(0, folder_set(BASE_STEP, base_dir, prompt))
    photos = load_photos(photos_dir)
    scorers = load_scorers(subject_type, photos, environ, with_fidelity=prompt is not None)
    photo_embeddings = embed_photos(scorers, photos)
    steps = [embed_step(scorers, renders) for renders in sets]
    section = scored_section(scorers, photo_embeddings, steps, {}, keep_best_step=False)
    renders = next(step for step in section["steps"] if step["step"] == FOLDER_RENDERS_STEP)
    summary = {key: renders[key] for key in SUMMARY_KEYS}
    if base_dir is not None:
        base = next(step for step in section["steps"] if step["step"] == BASE_STEP)
        summary["base_renders"] = {key: base[key] for key in SUMMARY_KEYS if key != "prompt_fidelity_change"}
    keep = ("subject_type", "subject_type_source", "calibration", "models", "note")
    folders = [folder for folder in (photos_dir, renders_dir, base_dir) if folder is not None]
    return {**summary, **{key: section[key] for key in keep}, "not_scored": not_scored(folders)}


def not_scored(folders: Sequence[Path]) -> dict[str, Any]:
    """The files in the `score` command's folders that it left out, named (the first MAX_NAMED_UNSCORED)."""
    files = [str(path) for folder in folders for path in unscored_files(folder)]
    return {
        "count": len(files),
        "files": files[:MAX_NAMED_UNSCORED],
        "reason": f"not an image format the command reads ({', '.join(sorted(IMAGE_EXTENSIONS))})",
    }
