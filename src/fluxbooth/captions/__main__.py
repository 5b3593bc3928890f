"""`python -m fluxbooth.captions --input captioning-input.json --output captions-output.json`: caption one job's
photos (fluxbooth.contract.captioning says what goes in and comes out).

Always writes the output. Exits 0 when it is `captioned`, or `unavailable` for a reason it can name (no model, no
device, no time, an unreadable photo); non-zero only on a crash, whose output is `unavailable` too and keeps the
captions finished before it. Logs one line per batch; never an environment value, never a caption.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fluxbooth.contract.captioning import CaptioningInput, unavailable_output

CRASH_EXIT_STATUS = 1


def quiet_libraries() -> None:
    """No progress bars or load reports from transformers and huggingface_hub in the job's log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def captioning_output(input_path: Path) -> tuple[dict[str, Any], int]:
    """The output to write and the exit status."""
    finished: dict[str, str] = {}
    try:
        request = CaptioningInput.read(input_path)
        # Inside the try: a library that fails to import still leaves an output that says so.
        from fluxbooth.captions.captioner import caption_photos

        return caption_photos(request, finished), 0
    except Exception as error:  # a crash: the output still says so, with what was finished
        traceback.print_exc(file=sys.stderr)
        reason = f"the captioner failed ({type(error).__name__}: {str(error)[:500]})"
        return unavailable_output(reason, finished), CRASH_EXIT_STATUS


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth.captions", description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, required=True, help="the job's captioning-input.json")
    parser.add_argument("--output", type=Path, required=True, help="where the captions output is written")
    arguments = parser.parse_args(argv)
    quiet_libraries()
    output, status = captioning_output(arguments.input)
    arguments.output.write_text(json.dumps(output, indent=2) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
