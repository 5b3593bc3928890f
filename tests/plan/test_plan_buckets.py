"""The planner under aspect buckets: memory sized for the largest bucket, time for the mix of buckets; before
the dataset is fetched every image stands at each size as a square, and the re-plan with the prepared
dataset (`choose_plan(..., bucket_mix=...)`) reads the real mix."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.plan import JobShape, Strategy, as_job, choose_plan, seconds_per_step
from fluxbooth.plan.timing import mixed_seconds_per_step
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec
from fluxbooth.sizing import FLUX_DEV_NAME, model_size
from tests.support.specs import job_spec

LORA_ZERO2 = Strategy("lora", True, 2, "none", "none")
H100 = hypothetical_hardware(
    gpus=1,
    gpu_memory_bytes=80 * GIB,
    host_memory_bytes=256 * GIB,
    disk_bytes=500 * GIB,
    cpu_count=16,
    gpu_name="NVIDIA H100 80GB HBM3",
)


def request(**fields: Any) -> JobSpec:
    return job_spec(
        parse_request(
            {
                "model_name": "sks",
                "dataset_url": "https://example.com/d.zip",
                "instance_prompt": "a photo of sks",
                **fields,
            }
        )
    )


def test_before_the_dataset_memory_is_sized_for_the_largest_size() -> None:
    job = as_job(request(resolution=[512, 1024]), 10)

    assert job.resolution == (1024, 1024)


def test_before_the_dataset_every_image_is_timed_at_each_size() -> None:
    job = as_job(request(resolution=[512, 1024]), 10)

    assert job.bucket_mix == ((512, 512, 10), (1024, 1024, 10))


def test_a_single_size_plans_as_its_square_did() -> None:
    bucketed, square = as_job(request(resolution=1024), 10), as_job(request(resolution="1024x1024"), 10)

    assert (bucketed.resolution, bucketed.training_mix) == (square.resolution, square.training_mix)


def test_with_the_prepared_dataset_memory_is_sized_for_the_largest_bucket_it_holds() -> None:
    job = as_job(request(resolution=[512, 1024]), 2, {(448, 592): 1, (592, 448): 1, (880, 1184): 1, (1184, 880): 1})

    assert job.resolution == (1184, 880)


def test_a_fixed_shape_is_planned_as_that_shape_alone() -> None:
    job = as_job(request(resolution="768x1024"), 10)

    assert (job.resolution, job.bucket_mix) == ((768, 1024), ())


def test_step_time_over_a_mix_weighs_each_bucket_by_the_batches_it_fills() -> None:
    model = model_size(FLUX_DEV_NAME)
    job = replace(JobShape(training_type="lora", batch_size=2), bucket_mix=((512, 512, 4), (1024, 1024, 2)))

    mixed = mixed_seconds_per_step(LORA_ZERO2, model, job, H100, 10**7, 2)

    small = seconds_per_step(LORA_ZERO2, model, replace(job, resolution=(512, 512)), H100, 10**7, 2)
    large = seconds_per_step(LORA_ZERO2, model, replace(job, resolution=(1024, 1024)), H100, 10**7, 2)
    assert mixed == (2 * small + 1 * large) / 3


def test_the_replan_with_a_dataset_of_small_buckets_predicts_less_time_and_memory() -> None:
    model = model_size(FLUX_DEV_NAME)
    job = request(resolution=[512, 1024], steps=500)

    before = choose_plan(job, H100, model, instance_images=10)
    after = choose_plan(job, H100, model, instance_images=10, bucket_mix={(512, 512): 10, (768, 768): 10})

    assert after.predicted_seconds_per_step < before.predicted_seconds_per_step
    assert after.predicted_gpu_bytes < before.predicted_gpu_bytes
