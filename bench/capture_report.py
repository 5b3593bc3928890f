"""The README's captured training report: a real job on the tiny model, its report PNGs copied to docs/report/.

A LoRA, 12 steps at 256² with a cosine schedule after 2 warm-up steps, a checkpoint at step 6, two validation
prompts rendered every 4 steps, on a dataset with the flaws the dataset check looks for: three framings of a
portrait (the one matplotlib ships), a byte-identical copy and a JPEG re-encode of the first, a blurred
framing, a scene without a face and a photo of two people. The tiny model is randomly initialised, so its
renders are noise that moves as it trains; the report's layout is what a real run gets.

`python bench/capture_report.py` runs the job (minutes on a CPU) and prints the result's warnings and checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "src")]

from tests.support.factories import make_zip, to_base64  # noqa: E402
from tests.support.photos import blurred, encoded, portrait, textured_photo, two_people  # noqa: E402

DOCS = REPO_ROOT / "docs" / "report"
PNGS = ("loss.png", "samples.png", "dataset.png")


def members() -> list[tuple[str, bytes]]:
    first = portrait(0, side=384)
    return [
        ("anna 1.jpg", encoded(first)),
        ("anna 1 copy.jpg", encoded(first)),
        ("anna 1 small.jpg", encoded(first.resize((288, 288)), quality=40)),
        ("anna 2.jpg", encoded(portrait(1, side=384))),
        ("anna 3.jpg", encoded(portrait(2, side=384))),
        ("anna 3.txt", b"a photo of sks woman, a slight turn of the head"),
        ("anna 4 blurred.jpg", encoded(blurred(portrait(2, side=384).rotate(8), 6))),
        ("garden.jpg", encoded(textured_photo(7, (384, 384)))),
        ("with a friend.jpg", encoded(two_people(side=384))),
    ]


def job_input() -> dict[str, Any]:
    return {
        "model_name": "sks-woman",
        "base_model": "fluxbooth/tiny-flux",
        "training_type": "lora",
        "lora_rank": 4,
        "dataset": to_base64(make_zip(members())),
        "instance_prompt": "a photo of sks woman",
        "steps": 12,
        "learning_rate": 1e-3,
        "lr_scheduler": "cosine",
        "lr_warmup_steps": 2,
        "checkpointing_steps": 6,
        "resolution": "256x256",
        "seed": 3,
        "validation_prompts": ["a photo of sks woman", "sks woman reading in a garden"],
        "validation_steps": 4,
    }


def main() -> None:
    from fluxbooth.job.run import run_job
    from fluxbooth.settings import WorkerSettings

    with tempfile.TemporaryDirectory() as scratch:
        env = {
            **os.environ,
            "FLUXBOOTH_WORK_DIR": f"{scratch}/work",
            "FLUXBOOTH_OUTPUT_DIR": f"{scratch}/out",
            "FLUXBOOTH_CACHE_DIR": os.environ.get("FLUXBOOTH_CACHE_DIR", f"{scratch}/cache"),
        }
        result = asyncio.run(run_job(job_input(), job_id="capture", settings=WorkerSettings.from_environ(env)))
        if "error" in result:
            raise SystemExit(json.dumps(result, indent=1))
        DOCS.mkdir(parents=True, exist_ok=True)
        for artifact in result["artifacts"]:
            if artifact["name"] in {f"report/{name}" for name in PNGS}:
                shutil.copyfile(unquote(urlsplit(artifact["uri"]).path), DOCS / Path(artifact["name"]).name)
    print(
        json.dumps(
            {
                "warnings": result["warnings"],
                "checks": result["dataset"]["checks"],
                "seconds": result["metrics"]["seconds"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
