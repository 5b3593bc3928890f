"""What the worker and the scoring process agree on: the request the job writes, the section it reads back.

Standard library only: the worker (which never imports torch) reads and writes these; the scoring process
(`python -m fluxbooth.likeness --input scoring-input.json --output likeness.json`) does the rest.

The section (likeness.json; the result's `likeness`), status "scored" (docs/likeness.md says what each means):
    {"status": "scored", "subject_type": "person"|"pet"|"object",
     "subject_type_source": "request" | "auto: 7 of 8 photos hold exactly one face",
     "models": [{"role": "likeness"|"variety"|"prompt_fidelity", "name", "revision", "sha256", "licence",
                 "status": "used"|"unavailable", "reason": str|None}],
     "calibration": {"zero", "zero_source", "one" (None with one photo), "one_source", "copy_similarity",
                     "scale": "calibrated: ..." | "raw similarity ... (uncalibrated...)"},
     "steps": [{"step", "renders", "likeness", "likeness_se", "face_detect_rate", "face_match_rate", "copies",
                "prompt_fidelity", "prompt_fidelity_change", "variety", "eligible", "failed_guards", "selected"}],
               # BASE_STEP first, the final step last; failed_guards from "copies", "prompt_fidelity",
               # "variety", "base model", "unscored"; numbers are None where nothing could be measured
     "selected_step": int|None, "selection": one sentence, "unscored_steps": [int], "unscored_reason": str|None,
     "note": PROXY_NOTE}
status "unavailable": unavailable_section(reason). Embeddings never leave the scoring process: only these numbers.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

SubjectType = Literal["person", "pet", "object"]
SUBJECT_TYPES: tuple[str, ...] = ("person", "pet", "object", "auto")
# The renders made before any training step (the base model, the same prompts and seeds): the scale's zero.
BASE_STEP = 0
# Under the trainer's output_dir: one LoRA per validation step when the request keeps the best step.
STEP_LORAS_FOLDER = "step_loras"
SCORING_INPUT_NAME = "scoring-input.json"
LIKENESS_RESULT_NAME = "likeness.json"
# What every likeness section says once, whatever it holds.
PROXY_NOTE = (
    "These scores are automatic proxies: they agree with people's judgement of likeness only moderately; "
    "look at the renders before you trust a choice."
)


@dataclass(frozen=True)
class ScoringInput:
    """One job's scoring request, written by the worker beside the trainer's output."""

    photos_dir: str  # the training photos (the instance folder)
    validation_dir: str  # output_dir/validation, with validation.json indexing every render by training_step
    subject_type: str  # one of SUBJECT_TYPES; "auto" decides from the photos (person when most hold one face)
    # Each validation prompt with the trigger word replaced by the class noun (what prompt fidelity reads), in
    # the order validation.json's records carry the prompts.
    fidelity_prompts: tuple[str, ...]
    keep_best_step: bool
    final_step: int  # the run's last step (its renders are the exported weights')
    stop_at_unix_seconds: float | None = None  # score fewer steps, newest first kept, rather than pass this
    # Where the scoring models may be found (HF cache, RunPod's cache, a volume): the worker's environment.
    environ: dict[str, str] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, path: Path) -> ScoringInput:
        values = json.loads(path.read_text())
        values["fidelity_prompts"] = tuple(values["fidelity_prompts"])
        return cls(**values)


def unavailable_section(reason: str) -> dict[str, Any]:
    """The likeness section when nothing could be scored: the job still succeeds and says why."""
    return {"status": "unavailable", "reason": reason, "steps": [], "selected_step": None, "note": PROXY_NOTE}


def read_likeness_section(path: Path) -> dict[str, Any]:
    """The section the scoring process wrote, or an `unavailable` one saying why it cannot be read."""
    try:
        section = json.loads(path.read_text())
    except FileNotFoundError:
        return unavailable_section("the scoring process wrote no result")
    except (OSError, ValueError) as error:
        return unavailable_section(f"the scoring result could not be read: {error}")
    if not isinstance(section, dict) or section.get("status") not in ("scored", "unavailable"):
        return unavailable_section("the scoring result is not a likeness section")
    return section
