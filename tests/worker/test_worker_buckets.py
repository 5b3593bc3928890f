"""Issue 18's job through the worker: a LoRA on the tiny model with a trigger word, caption dropout, aspect
buckets at two sizes, FLUX's resolution-dependent timestep shift, an EMA and LoRA dropout, on photos of three
aspect ratios (one of them an iPhone-style HEIC, one a JPEG in Display P3), trained by the real trainer under
`accelerate launch` + DeepSpeed. One run, read by every test here."""

from __future__ import annotations

import asyncio
import io
import json
import math
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pillow_heif
import pytest
from PIL import Image

from fluxbooth.job.run import run_job
from fluxbooth.settings import TINY_MODEL_NAME, WorkerSettings
from tests.conftest import worker_environment
from tests.support.colour_profiles import display_p3_profile
from tests.support.factories import make_zip, to_base64
from tests.support.photos import encoded, textured_photo

pytestmark = pytest.mark.slow

STEPS = 4
# Three aspect ratios, two photos each: 4:3, 3:4 and 16:9.
PHOTO_SIZES = {"landscape": (640, 480), "portrait": (480, 640), "wide": (768, 432)}


def heic(image: Image.Image) -> bytes:
    """HEIC as a phone writes it (HEVC in HEIF), through libheif."""
    buffer = io.BytesIO()
    pillow_heif.from_pillow(image).save(buffer, quality=90)
    return buffer.getvalue()


def display_p3_jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92, icc_profile=display_p3_profile())
    return buffer.getvalue()


def dataset_members() -> list[tuple[str, bytes]]:
    members = []
    for seed, (name, size) in enumerate(PHOTO_SIZES.items()):
        for copy in range(2):
            members.append((f"{name}{copy}.jpg", encoded(textured_photo(10 * seed + copy, size))))
    # Photos as phones take them, in the same buckets: a HEIC landscape and a Display P3 portrait.
    members[1] = ("landscape1.heic", heic(textured_photo(1, PHOTO_SIZES["landscape"])))
    members[3] = ("portrait1.jpg", display_p3_jpeg(textured_photo(11, PHOTO_SIZES["portrait"])))
    members.append(("landscape0.txt", b"a dog on the grass"))
    return members


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, model_cache_dir: Path, torch_extensions_dir: Path) -> dict[str, Any]:
    # Planned for at most 10 images before the dataset arrives: the CPU's time estimate for caching a thousand
    # at two sizes would not fit the default deadline.
    env = {
        **worker_environment(tmp_path_factory.mktemp("buckets-job"), model_cache_dir, torch_extensions_dir),
        "FLUXBOOTH_MAX_IMAGES": "10",
    }
    job_input = {
        "model_name": "sks-buckets",
        "base_model": TINY_MODEL_NAME,
        "training_type": "lora",
        "lora_rank": 4,
        "dataset": to_base64(make_zip(dataset_members())),
        "instance_prompt": "a photo of [trigger] dog",
        "trigger_word": "sks",
        "caption_dropout": 0.5,
        "resolution": [256, 384],
        "steps": STEPS,
        "seed": 7,
        "timestep_sampling": "flux_shift",
        "ema_decay": 0.9,
        "lora_dropout": 0.1,
    }
    progress: list[dict[str, Any]] = []
    result = asyncio.run(
        run_job(job_input, job_id="buckets", settings=WorkerSettings.from_environ(env), progress=progress.append)
    )
    assert "error" not in result, result
    return {"result": result, "progress": progress}


def test_the_result_lists_the_buckets_with_their_images(job: dict[str, Any]) -> None:
    # 4:3, 3:4 and 16:9 at 256 and at 384 px: two photos each.
    assert job["result"]["dataset"]["buckets"] == [
        {"width": 224, "height": 288, "images": 2},
        {"width": 288, "height": 224, "images": 2},
        {"width": 336, "height": 192, "images": 2},
        {"width": 336, "height": 448, "images": 2},
        {"width": 448, "height": 336, "images": 2},
        {"width": 512, "height": 288, "images": 2},
    ]


def test_the_trainer_cached_the_buckets_the_result_lists(job: dict[str, Any]) -> None:
    (ready,) = [
        update for update in job["progress"] if update.get("stage") == "cache" and update.get("status") == "ready"
    ]
    listed = {
        f"{bucket['width']}x{bucket['height']}": bucket["images"] for bucket in job["result"]["dataset"]["buckets"]
    }

    assert ready["buckets"] == listed


def test_no_photo_was_cropped_to_fit(job: dict[str, Any]) -> None:
    assert job["result"]["dataset"]["cropped"] == 0


def test_the_result_names_the_trigger_word(job: dict[str, Any]) -> None:
    assert job["result"]["dataset"]["trigger_word"] == "sks"


def test_the_job_trained_every_step_to_a_finite_loss(job: dict[str, Any]) -> None:
    metrics = job["result"]["metrics"]
    assert metrics["steps"] == STEPS
    assert math.isfinite(metrics["final_loss"])


def test_the_lora_weights_and_their_ema_are_in_the_result(job: dict[str, Any]) -> None:
    names = [artifact["name"] for artifact in job["result"]["artifacts"] if artifact["name"].endswith(".safetensors")]
    assert any(name.startswith("ema_") for name in names)
    assert any(not name.startswith("ema_") for name in names)


def lora_metadata(job: dict[str, Any]) -> dict[str, str]:
    from safetensors import safe_open

    (uri,) = [
        artifact["uri"]
        for artifact in job["result"]["artifacts"]
        if artifact["name"] == "lora/pytorch_lora_weights.safetensors"
    ]
    with safe_open(unquote(urlsplit(uri).path), framework="pt") as opened:
        return dict(opened.metadata())


def test_the_lora_file_names_the_trigger_word_and_its_buckets(job: dict[str, Any]) -> None:
    metadata = lora_metadata(job)

    assert metadata["modelspec.trigger_phrase"] == "sks"
    buckets = json.loads(metadata["ss_bucket_info"])["buckets"].values()
    assert sorted((*bucket["resolution"], bucket["count"]) for bucket in buckets) == [
        (bucket["width"], bucket["height"], bucket["images"]) for bucket in job["result"]["dataset"]["buckets"]
    ]


def test_captions_trained_with_the_trigger_word_put_in(job: dict[str, Any]) -> None:
    tags = json.loads(lora_metadata(job)["ss_tag_frequency"])["instance"]

    assert tags == {"sks a dog on the grass": 1, "a photo of sks dog": 5}


def test_the_heic_and_the_display_p3_photos_were_trained_on(job: dict[str, Any]) -> None:
    dataset = job["result"]["dataset"]
    assert (dataset["instance_images"], dataset["skipped"]) == (6, {})
