"""`python -m fluxbooth.likeness --input scoring-input.json --output likeness.json`: score one job's renders.

Always exits 0 with a section written: whatever goes wrong (a model missing, no renders, an error) makes the
section `unavailable` with the reason, so the job never fails because scoring could not run. Only the section's
numbers are written; no embedding, no image and nothing about a face is logged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fluxbooth.contract.scoring import ScoringInput, unavailable_section
from fluxbooth.likeness.inputs import NothingToScore
from fluxbooth.likeness.weights import ModelUnavailable


def quiet_libraries() -> None:
    """No progress bars or load reports from transformers and huggingface_hub in the job's log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def section_for(input_path: Path) -> dict[str, Any]:
    """The section, or an `unavailable` one saying why not."""
    try:
        scoring_input = ScoringInput.read(input_path)
        if not scoring_input.environ:
            scoring_input = dataclasses.replace(scoring_input, environ=dict(os.environ))
        from fluxbooth.likeness.scoring import score_job  # after the input is read: it loads numpy, PIL, dlib

        return score_job(scoring_input)
    except (ModelUnavailable, NothingToScore) as error:
        return unavailable_section(str(error))
    except Exception as error:  # any failure: scoring is optional, the job goes on without it
        return unavailable_section(f"scoring failed ({type(error).__name__}: {str(error)[:500]})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth.likeness", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="the job's scoring-input.json")
    parser.add_argument("--output", type=Path, required=True, help="where the likeness section is written")
    arguments = parser.parse_args(argv)
    quiet_libraries()
    section = section_for(arguments.input)
    arguments.output.write_text(json.dumps(section, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
