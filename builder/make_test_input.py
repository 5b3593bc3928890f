"""Regenerate test_input.json and .runpod/tests.json: a tiny, deterministic DreamBooth LoRA job for the built-in
tiny model, with a trigger word, and no field that draws a warning.

The dataset is drawn here (a few small JPEGs of the same toy in different poses), so no photo is
checked in. `python builder/make_test_input.py` rewrites ../test_input.json.
"""

from __future__ import annotations

import base64
import io
import json
import zipfile
from pathlib import Path

from PIL import Image, ImageDraw

IMAGE_SIDE = 96
POSES = ((20, 24), (36, 30), (28, 44), (44, 40))


def draw_toy(offset: tuple[int, int]) -> bytes:
    """A red toy with a yellow hat on a blue-grey floor: the same subject at several positions."""
    image = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (120, 140, 160))
    draw = ImageDraw.Draw(image)
    x, y = offset
    draw.rectangle((0, 70, IMAGE_SIDE, IMAGE_SIDE), fill=(90, 100, 110))
    draw.ellipse((x, y, x + 32, y + 32), fill=(200, 40, 40))
    draw.polygon([(x + 4, y + 6), (x + 16, y - 14), (x + 28, y + 6)], fill=(240, 210, 40))
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=80)
    return buffer.getvalue()


def build_dataset_zip() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for index, pose in enumerate(POSES, start=1):
            info = zipfile.ZipInfo(f"photo{index}.jpg", date_time=(2026, 1, 1, 0, 0, 0))
            archive.writestr(info, draw_toy(pose))
        caption = zipfile.ZipInfo("photo1.txt", date_time=(2026, 1, 1, 0, 0, 0))
        archive.writestr(caption, "a photo of sks toy on the floor")
    return buffer.getvalue()


def build_test_input() -> dict[str, object]:
    return {
        "input": {
            "model_name": "sks-toy-demo",
            "base_model": "fluxbooth/tiny-flux",
            "dataset": base64.b64encode(build_dataset_zip()).decode("ascii"),
            "training_type": "lora",
            "trigger_word": "sks",
            "instance_prompt": "a photo of sks toy",
            "steps": 8,
            "learning_rate": 1e-4,
            "batch_size": 1,
            "gradient_accumulation_steps": 1,
            "resolution": "64x64",
            "use_deepspeed": True,
            "mixed_precision": "bf16",
            "gradient_checkpointing": True,
            "seed": 42,
            # The demo stays offline and small: it renders its samples, but scoring a toy needs DINOv2 and SigLIP
            # (a download of both). `python -m fluxbooth score` and docs/likeness.md show the scores.
            "likeness": False,
        }
    }


def write_demo(repo_root: Path) -> None:
    """test_input.json, and the same input as the Hub's test in .runpod/tests.json."""
    demo = build_test_input()
    target = repo_root / "test_input.json"
    target.write_text(json.dumps(demo, indent=2) + "\n")
    print(f"wrote {target} ({target.stat().st_size} bytes)")
    hub_tests_path = repo_root / ".runpod" / "tests.json"
    hub_tests = json.loads(hub_tests_path.read_text())
    hub_tests["tests"][0]["input"] = demo["input"]
    hub_tests_path.write_text(json.dumps(hub_tests, indent=2) + "\n")
    print(f"wrote {hub_tests_path}")


if __name__ == "__main__":
    write_demo(Path(__file__).resolve().parent.parent)
