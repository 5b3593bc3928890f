"""What the worker tells the trainer (train.json) about where things live and how to cache, from the plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fluxbooth.configs import trainer_config_for
from fluxbooth.request import parse_request
from fluxbooth.contract.names import sampling_defaults
from fluxbooth.contract.trainer_config import TrainerConfig
from tests.factories import make_dataset_zip, to_base64
from tests.test_configs import GUIDE_DEFAULT_PLAN


def config_for(job_dir: Path, **keywords: object) -> TrainerConfig:
    request = parse_request(
        {"model_name": "sks-dog", "dataset": to_base64(make_dataset_zip(count=3)), "instance_prompt": "a photo of sks dog"}
    )
    arguments: dict[str, object] = {
        "base_model": "/models/flux", "instance_dir": job_dir / "data" / "instance", "class_dir": None, "job_dir": job_dir,
    }
    plan = keywords.pop("plan", GUIDE_DEFAULT_PLAN)
    return trainer_config_for(request, plan, **{**arguments, **keywords})  # type: ignore[arg-type]


def test_generated_class_images_are_cached_where_the_worker_says(tmp_path: Path) -> None:
    config = config_for(tmp_path / "job", class_image_cache_dir=tmp_path / "cache" / "class-images")
    assert config.class_image_cache_dir == str(tmp_path / "cache" / "class-images")


def test_without_a_class_image_cache_generated_class_images_stay_in_the_job(tmp_path: Path) -> None:
    assert config_for(tmp_path / "job").class_image_cache_dir is None


def test_a_plan_that_caches_encoders_on_the_cpu_tells_the_trainer(tmp_path: Path) -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, cache_encoders_on_cpu=True)
    assert config_for(tmp_path / "job", plan=plan).encoders_on_cpu is True


def test_a_plan_that_caches_encoders_on_the_gpu_tells_the_trainer(tmp_path: Path) -> None:
    assert config_for(tmp_path / "job").encoders_on_cpu is False


def sampling_of(config: TrainerConfig) -> tuple[object, ...]:
    return (config.max_sequence_length, config.validation_inference_steps, config.validation_guidance_scale, config.class_image_inference_steps)


def test_the_worker_leaves_t5_length_and_sampling_to_the_model(tmp_path: Path) -> None:
    assert sampling_of(config_for(tmp_path / "job")) == (None, None, None, None)


def test_sampling_left_to_a_model_with_guidance_embedding_follows_flux_dev(tmp_path: Path) -> None:
    config = config_for(tmp_path / "job").with_sampling_defaults(sampling_defaults({"guidance_embeds": True}))
    assert sampling_of(config) == (512, 28, 3.5, 28)


def test_sampling_left_to_a_model_without_guidance_embedding_follows_flux_schnell(tmp_path: Path) -> None:
    config = config_for(tmp_path / "job").with_sampling_defaults(sampling_defaults({"guidance_embeds": False}))
    assert sampling_of(config) == (256, 4, 0.0, 4)


def test_sampling_set_in_train_json_is_kept_whatever_the_model(tmp_path: Path) -> None:
    config = replace(config_for(tmp_path / "job"), max_sequence_length=128, validation_inference_steps=8)
    filled = config.with_sampling_defaults(sampling_defaults({"guidance_embeds": False}))
    assert sampling_of(filled) == (128, 8, 0.0, 4)
