"""What the worker tells the trainer (train.json) about where things live and how to cache, from the plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.job.launch_files import trainer_config_for
from fluxbooth.request.model import parse_request
from fluxbooth.sizing import FLUX_DEV_NAME, FLUX_SCHNELL_NAME, model_size
from tests.support.factories import make_dataset_zip, to_base64
from tests.support.guide_job import GUIDE_DEFAULT_PLAN
from tests.support.specs import job_spec


def config_for(job_dir: Path, base_model_name: str = FLUX_DEV_NAME, **keywords: object) -> TrainerConfig:
    request = parse_request(
        {
            "model_name": "sks-dog",
            "dataset": to_base64(make_dataset_zip(count=3)),
            "instance_prompt": "a photo of sks dog",
        }
    )
    arguments: dict[str, object] = {
        "base_model": "/models/flux",
        "instance_dir": job_dir / "data" / "instance",
        "class_dir": None,
        "job_dir": job_dir,
    }
    plan = keywords.pop("plan", GUIDE_DEFAULT_PLAN)
    spec = job_spec(request, model_size(base_model_name))
    return trainer_config_for(spec, plan, **{**arguments, **keywords})  # type: ignore[arg-type]


def test_generated_class_images_are_cached_where_the_worker_says(tmp_path: Path) -> None:
    config = config_for(tmp_path / "job", class_image_cache_dir=tmp_path / "cache" / "class-images")
    assert config.class_image_cache_dir == str(tmp_path / "cache" / "class-images")


def test_without_a_class_image_cache_generated_class_images_stay_in_the_job(tmp_path: Path) -> None:
    assert config_for(tmp_path / "job").class_image_cache_dir is None


def test_a_plan_that_caches_encoders_on_the_cpu_tells_the_trainer(tmp_path: Path) -> None:
    plan = replace(GUIDE_DEFAULT_PLAN, cache_encoders_on_cpu=True)
    assert config_for(tmp_path / "job", plan=plan).memory.encoders_on_cpu is True


def test_a_plan_that_caches_encoders_on_the_gpu_tells_the_trainer(tmp_path: Path) -> None:
    assert config_for(tmp_path / "job").memory.encoders_on_cpu is False


def sampling_of(config: TrainerConfig) -> tuple[object, ...]:
    return (
        config.sampling.max_sequence_length,
        config.sampling.validation_inference_steps,
        config.sampling.validation_guidance_scale,
        config.sampling.class_image_inference_steps,
    )


def test_the_worker_writes_the_t5_length_and_sampling_of_the_model(tmp_path: Path) -> None:
    assert None not in sampling_of(config_for(tmp_path / "job"))


def test_sampling_of_a_model_with_guidance_embedding_follows_flux_dev(tmp_path: Path) -> None:
    assert sampling_of(config_for(tmp_path / "job", FLUX_DEV_NAME)) == (512, 28, 3.5, 28)


def test_sampling_of_a_model_without_guidance_embedding_follows_flux_schnell(tmp_path: Path) -> None:
    assert sampling_of(config_for(tmp_path / "job", FLUX_SCHNELL_NAME)) == (256, 4, 0.0, 4)
