"""Likeness scoring as the request asks for it and the job spec resolves it: the default validation prompts, the
class noun, the prompts prompt fidelity reads, the refusals of `keep_best_step` and `likeness`, and what the plan and
the trainer's config make of them."""

from __future__ import annotations

import typing
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.budgets import MAX_SCORED_PHOTOS
from fluxbooth.contract.scoring import STEP_LORAS_FOLDER, SUBJECT_TYPES
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.job.launch_files import trainer_config_for
from fluxbooth.plan import as_job, choose_plan
from fluxbooth.plan.memory import estimate_memory
from fluxbooth.plan.timing import SCORING_MODEL_LOAD_SECONDS, SCORING_SECONDS_PER_IMAGE
from fluxbooth.plan.types import Strategy
from fluxbooth.request.model import TrainingRequest
from fluxbooth.request.spec import DEFAULT_VALIDATION_SCENES
from fluxbooth.sizing import FLUX_DEV_NAME, model_size
from tests.support.guide_job import LORA_PLAN
from tests.support.request_inputs import url_request, url_request_refusal
from tests.support.specs import job_spec

H100 = hypothetical_hardware(
    gpus=1,
    gpu_memory_bytes=80 * GIB,
    host_memory_bytes=256 * GIB,
    disk_bytes=500 * GIB,
    cpu_count=16,
    gpu_name="NVIDIA H100 80GB HBM3",
)
KONTEXT = "black-forest-labs/FLUX.1-Kontext-dev"
LORA = Strategy("lora", True, 2, "none", "none")


request = url_request
refusal = url_request_refusal


# ---- the default validation prompts ---------------------------------------------------------------------------


def test_a_request_without_validation_prompts_renders_the_instance_prompt_and_two_new_scenes() -> None:
    spec = job_spec(request(trigger_word="sks", class_prompt="a photo of a dog"))

    assert spec.validation_prompts == (
        "a photo of sks dog",
        "a photo of sks dog, on a beach at sunset",
        "a photo of sks dog, in a snowy forest",
    )
    assert spec.default_validation_prompts


def test_without_a_trigger_word_the_instance_prompt_stands_for_the_subject_in_the_new_scenes() -> None:
    spec = job_spec(request(instance_prompt="TOK"))

    assert spec.validation_prompts == ("TOK", *(f"TOK, {scene}" for scene in DEFAULT_VALIDATION_SCENES))


def test_an_empty_list_of_validation_prompts_turns_the_renders_and_the_scoring_off() -> None:
    spec = job_spec(request(validation_prompts=[]))

    assert (spec.validation_prompts, spec.default_validation_prompts, spec.likeness) == ((), False, False)


def test_the_requests_own_validation_prompts_are_rendered_instead_of_the_defaults() -> None:
    spec = job_spec(request(validation_prompts=["a [trigger] dog"], trigger_word="sks"))

    assert (spec.validation_prompts, spec.default_validation_prompts) == (("a sks dog",), False)


def test_flux_kontext_gets_no_default_validation_prompts_and_no_scoring() -> None:
    spec = job_spec(request(), model_size(KONTEXT))

    assert (spec.validation_prompts, spec.likeness) == ((), False)


def test_flux_kontext_refuses_keep_best_step_without_validation_prompts() -> None:
    with pytest.raises(FluxboothError) as caught:
        job_spec(request(keep_best_step=True, validation_steps=10), model_size(KONTEXT))

    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "input.validation_steps, input.keep_best_step: FLUX.1 Kontext [dev] (FluxKontextPipeline) gets no default "
        "validation prompts (each needs its control image); give validation_prompts with validation_images, or remove "
        "validation_steps and keep_best_step"
    )


# ---- the class noun and the prompts prompt fidelity reads -------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "noun"),
    [
        ({"class_prompt": "a photo of a Golden Retriever, high quality", "with_prior_preservation": True}, "retriever"),
        ({"trigger_word": "sks", "instance_prompt": "a photo of sks cat"}, "cat"),
        ({"subject_type": "person", "instance_prompt": "TOK"}, "person"),
        ({"subject_type": "pet", "instance_prompt": "TOK"}, "pet"),
        ({"subject_type": "object", "instance_prompt": "TOK"}, "object"),
        ({"instance_prompt": "TOK"}, "subject"),
    ],
)
def test_the_class_noun_comes_from_the_class_prompt_else_the_word_after_the_trigger_else_the_subject_type(
    fields: dict[str, Any],
    noun: str,
) -> None:
    assert job_spec(request(**fields)).class_noun == noun


def test_prompt_fidelity_reads_each_validation_prompt_with_the_trigger_word_replaced_by_the_class_noun() -> None:
    spec = job_spec(
        request(
            trigger_word="sks",
            class_prompt="a photo of a dog",
            validation_prompts=["a sks dog in the snow", "sks on a boat"],
        )
    )

    assert spec.fidelity_prompts == ("a dog in the snow", "dog on a boat")


def test_without_a_trigger_word_prompt_fidelity_reads_the_prompts_as_they_are() -> None:
    spec = job_spec(request(validation_prompts=["a photo of sks dog"]))

    assert spec.fidelity_prompts == ("a photo of sks dog",)


# ---- likeness, keep_best_step and subject_type --------------------------------------------------------------------


def test_likeness_is_on_whenever_validation_prompts_are_rendered() -> None:
    assert job_spec(request()).likeness
    assert job_spec(request(validation_prompts=["a sks dog"])).likeness


def test_likeness_false_keeps_the_renders_without_scoring_them() -> None:
    spec = job_spec(request(likeness=False))

    assert (len(spec.validation_prompts), spec.likeness) == (3, False)


def test_the_request_offers_the_subject_types_the_scorer_knows() -> None:
    assert typing.get_args(TrainingRequest.model_fields["subject_type"].annotation) == SUBJECT_TYPES


def test_likeness_with_validation_prompts_turned_off_is_refused() -> None:
    assert refusal(likeness=True, validation_prompts=[]) == (
        "invalid request: input.likeness: scores the validation renders, and input.validation_prompts [] turns them "
        "off; give prompts, leave validation_prompts out for the defaults, or remove likeness"
    )


def test_keep_best_step_without_likeness_is_refused() -> None:
    assert refusal(keep_best_step=True, likeness=False, validation_steps=100) == (
        "invalid request: input.keep_best_step: chooses the step by its likeness score, and likeness is off "
        "(likeness false or validation_prompts []); remove keep_best_step, or leave likeness and validation_prompts out"
    )


def test_keep_best_step_on_a_full_fine_tune_is_refused_for_a_transformer_per_validation_step() -> None:
    assert refusal(keep_best_step=True, training_type="full", validation_steps=100) == (
        "invalid request: input.keep_best_step: applies to training_type 'lora' (it keeps the weights of every "
        "validation step, a full transformer each for a full fine-tune); remove it or set training_type 'lora'"
    )


def test_keep_best_step_without_validation_steps_is_refused_as_nothing_to_choose_between() -> None:
    assert refusal(keep_best_step=True) == (
        "invalid request: input.keep_best_step: needs input.validation_steps (without renders during training there "
        "is only the final step, nothing to choose between); add validation_steps or remove keep_best_step"
    )


def test_keep_best_step_with_validation_steps_is_accepted() -> None:
    spec = job_spec(request(keep_best_step=True, validation_steps=100, subject_type="pet"))

    assert (spec.keep_best_step, spec.likeness, spec.subject_type) == (True, True, "pet")


# ---- the trainer's config -------------------------------------------------------------------------------------------


def trainer_for(tmp_path: Path, **fields: Any) -> Any:
    return trainer_config_for(
        job_spec(request(**fields)),
        LORA_PLAN,
        base_model="/models/flux",
        instance_dir=tmp_path / "i",
        class_dir=None,
        job_dir=tmp_path,
    )


def test_with_likeness_the_trainer_renders_the_base_model_before_the_first_step(tmp_path: Path) -> None:
    assert trainer_for(tmp_path).validation.at_start
    assert not trainer_for(tmp_path, likeness=False).validation.at_start


def test_keep_best_step_has_the_trainer_save_the_lora_of_every_validation_step(tmp_path: Path) -> None:
    trainer = trainer_for(tmp_path, keep_best_step=True, validation_steps=100)

    assert trainer.validation.step_loras_dir == str(tmp_path / "output" / STEP_LORAS_FOLDER)
    assert trainer_for(tmp_path).validation.step_loras_dir is None


# ---- the plan ------------------------------------------------------------------------------------------------------


def plan_phases(images: int = 10, **fields: Any) -> dict[str, float]:
    model = model_size(FLUX_DEV_NAME)
    return {
        name: phase.seconds
        for name, phase in choose_plan(as_job(job_spec(request(**fields)), images), H100, model).phases
    }


def test_the_step_0_renders_are_one_more_validation_round() -> None:
    job = as_job(job_spec(request(validation_steps=250, steps=1000)), 10)

    assert (job.validation_rounds, replace(job, likeness=False).validation_rounds) == (5, 4)


def test_the_plan_counts_the_default_renders_and_the_scoring() -> None:
    scored = plan_phases()
    off = plan_phases(validation_prompts=[])

    assert (off["validation"], off["scoring"]) == (0.0, 0.0)
    assert scored["validation"] > 0
    # Ten photos and three prompts in two rounds (the base model's and the final one), each image embedded once.
    assert scored["scoring"] == pytest.approx(
        SCORING_MODEL_LOAD_SECONDS + (10 + 2 * 3) * SCORING_SECONDS_PER_IMAGE, abs=0.1
    )


def test_the_plan_counts_no_scoring_when_likeness_is_off() -> None:
    phases = plan_phases(likeness=False)

    assert phases["validation"] > 0
    assert phases["scoring"] == 0.0


def test_keep_best_step_plans_disk_for_the_lora_of_every_validation_step() -> None:
    model = model_size(FLUX_DEV_NAME)
    kept = as_job(job_spec(request(keep_best_step=True, validation_steps=250, steps=1000)), 10)
    kept_estimate = estimate_memory(LORA, model, kept, H100, "bf16")
    final_only = estimate_memory(LORA, model, replace(kept, keep_best_step=False), H100, "bf16")
    one = kept_estimate.breakdown["disk.exported_weights_and_cache"]
    none = final_only.breakdown["disk.exported_weights_and_cache"]
    lora_bytes = kept_estimate.breakdown["trainable_params"] * 2

    assert one - none == 3 * lora_bytes


def test_a_deadline_too_short_for_scoring_every_step_warns_and_does_not_refuse() -> None:
    model = model_size(FLUX_DEV_NAME)
    job = as_job(job_spec(request(steps=10)), 10)
    unlimited = choose_plan(job, H100, model)
    deadline = (unlimited.predicted_total_seconds or 0) - dict(unlimited.phases)["scoring"].seconds / 2

    plan = choose_plan(job, H100, model, deadline_seconds=deadline)

    assert any(warning.startswith("likeness: the job deadline leaves ≈") for warning in plan.warnings)


def test_the_plan_counts_at_most_max_scored_photos_however_large_the_dataset() -> None:
    scored = plan_phases(images=1000)

    assert scored["scoring"] == pytest.approx(
        SCORING_MODEL_LOAD_SECONDS + (MAX_SCORED_PHOTOS + 2 * 3) * SCORING_SECONDS_PER_IMAGE, abs=0.1
    )
