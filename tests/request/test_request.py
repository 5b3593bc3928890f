"""The request contract: what `job["input"]` accepts, what it refuses, and how refusals read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.contract.buckets import Resolution
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.model import TrainingRequest, parse_request
from fluxbooth.settings import TINY_MODEL_NAME
from tests.support.factories import make_dataset_zip, to_base64
from tests.support.request_inputs import minimal, refusal
from tests.support.specs import job_spec


@pytest.fixture(scope="module")
def dataset_b64() -> str:
    return to_base64(make_dataset_zip(count=3))


def guide_basic_request(dataset: str) -> dict[str, Any]:
    """The reference guide's "Basic Training Request", verbatim except for the placeholder."""
    return {
        "model_name": "my_dreambooth_model",
        "dataset": dataset,
        "instance_prompt": "a photo of sks person",
        "class_prompt": "a photo of a person",
        "steps": 2000,
        "learning_rate": 2e-6,
        "batch_size": 1,
        "use_deepspeed": True,
    }


def guide_advanced_request(dataset: str) -> dict[str, Any]:
    """The reference guide's "Advanced Configuration", verbatim except for the placeholder."""
    return {
        "model_name": "my_dreambooth_model",
        "dataset": dataset,
        "instance_prompt": "a photo of sks person",
        "class_prompt": "a photo of a person",
        "steps": 2000,
        "learning_rate": 2e-6,
        "batch_size": 1,
        "gradient_accumulation_steps": 2,
        "resolution": "1024x1024",
        "with_prior_preservation": True,
        "prior_loss_weight": 1.0,
        "num_class_images": 50,
        "use_deepspeed": True,
        "mixed_precision": "fp16",
        "gradient_checkpointing": True,
    }


# ------------------------------------------------------------------------------------------ the guide


def test_guide_basic_request_validates_as_written(dataset_b64: str) -> None:
    request = parse_request(guide_basic_request(dataset_b64))

    assert request.steps == 2000
    assert request.learning_rate == 2e-6
    assert request.class_prompt == "a photo of a person"
    assert request.use_deepspeed is True


def test_guide_advanced_request_validates_as_written(dataset_b64: str) -> None:
    request = parse_request(guide_advanced_request(dataset_b64))

    assert request.resolution == Resolution(fixed=(1024, 1024))
    assert request.gradient_accumulation_steps == 2
    assert request.with_prior_preservation is True
    assert request.mixed_precision == "fp16"


def test_guide_advanced_request_warns_that_fp16_overflows_flux(dataset_b64: str) -> None:
    warnings = parse_request(guide_advanced_request(dataset_b64)).warnings()

    assert any("fp16" in warning and "bf16" in warning and "overflow" in warning for warning in warnings)


def test_guide_basic_request_notes_that_class_prompt_is_unused_without_prior_preservation(
    dataset_b64: str,
) -> None:
    warnings = parse_request(guide_basic_request(dataset_b64)).warnings()

    assert "class_prompt is ignored because with_prior_preservation is false" in warnings


# ------------------------------------------------------------------------------------------- defaults


def test_defaults_follow_the_design(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64))

    assert request.mixed_precision == "bf16"
    assert request.resolution == Resolution(sizes=(1024,))
    assert request.steps == 1000
    assert request.seed == 42
    assert request.training_type == "lora"
    assert request.base_precision == "auto"
    assert request.zero_stage == "auto"
    assert request.offload == "auto"
    assert request.base_model is None
    assert request.validation_prompts is None
    assert (request.subject_type, request.likeness, request.keep_best_step) == ("auto", None, False)
    assert request.warnings() == []


def test_effective_learning_rate_defaults_to_2e_6_for_full_fine_tune(dataset_b64: str) -> None:
    assert job_spec(parse_request(minimal(dataset_b64, training_type="full"))).optimisation.learning_rate == 2e-6


def test_effective_learning_rate_defaults_to_1e_4_for_lora(dataset_b64: str) -> None:
    assert job_spec(parse_request(minimal(dataset_b64))).optimisation.learning_rate == 1e-4


def test_explicit_learning_rate_wins_over_the_default(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, training_type="lora", learning_rate=5e-5))

    assert job_spec(request).optimisation.learning_rate == 5e-5


def test_lora_alpha_defaults_to_the_rank(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, training_type="lora", lora_rank=32))

    assert job_spec(request).lora.alpha == 32.0


def test_dataset_url_alone_is_accepted() -> None:
    request = parse_request(
        {"model_name": "m", "dataset_url": "https://example.com/d.zip?sig=1", "instance_prompt": "sks"}
    )

    assert request.dataset is None
    assert request.dataset_url == "https://example.com/d.zip?sig=1"


def test_data_uri_prefix_is_accepted(dataset_b64: str) -> None:
    request = parse_request(minimal("data:application/zip;base64," + dataset_b64))

    assert request.dataset is not None


# ----------------------------------------------------------------------------------------- resolution


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (512, Resolution(sizes=(512,))),
        ("512", Resolution(sizes=(512,))),
        ([1024, 512, 768], Resolution(sizes=(512, 768, 1024))),
        ([768, 1024], Resolution(sizes=(768, 1024))),
        ("512,768, 1024", Resolution(sizes=(512, 768, 1024))),
        ("1024x1024", Resolution(fixed=(1024, 1024))),
        ("768x1024", Resolution(fixed=(768, 1024))),
    ],
)
def test_resolution_spellings_are_sizes_for_aspect_buckets_or_one_fixed_shape(
    dataset_b64: str, given: object, expected: Resolution
) -> None:
    assert parse_request(minimal(dataset_b64, resolution=given)).resolution == expected


def test_resolution_not_a_multiple_of_16_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, resolution=1000))

    assert (
        message == "invalid request: input.resolution: each size must be a multiple of 16 between 64 and 2048, got 1000"
    )


def test_a_fixed_shape_not_a_multiple_of_16_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, resolution="1000x1024"))

    assert (
        message
        == "invalid request: input.resolution: each side must be a multiple of 16 between 64 and 2048, got 1000x1024"
    )


def test_resolution_too_large_is_refused(dataset_b64: str) -> None:
    assert "input.resolution:" in refusal(minimal(dataset_b64, resolution="4096x4096"))


def test_resolution_garbage_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, resolution="big"))

    assert message == (
        "invalid request: input.resolution: expected a size like 1024, sizes like [512, 768, 1024] (aspect buckets) "
        "or a fixed shape like '768x1024' (width x height)"
    )


def test_resolution_boolean_is_refused(dataset_b64: str) -> None:
    assert "input.resolution:" in refusal(minimal(dataset_b64, resolution=True))


# ------------------------------------------------------------------------------ types, ranges, unknowns


def test_non_object_input_is_refused() -> None:
    assert refusal(["model_name", "x"]) == "input: expected a JSON object with the training fields, got list"


def test_missing_required_fields_are_each_named() -> None:
    message = refusal({"dataset": "UEsFBg=="})

    assert "input.model_name: Field required" in message
    assert "input.instance_prompt: Field required" in message


def test_unknown_field_is_refused_by_name(dataset_b64: str) -> None:
    assert "input.learning_rat: unknown field" in refusal(minimal(dataset_b64, learning_rat=1e-5))


def test_out_of_range_steps_names_the_field_and_pydantic_reason(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, steps=0))

    assert "input.steps: Input should be greater than or equal to 1" in message


def test_absurd_batch_size_is_refused(dataset_b64: str) -> None:
    assert "input.batch_size: Input should be less than or equal to 64" in refusal(
        minimal(dataset_b64, batch_size=100_000)
    )


def test_number_sent_as_string_is_refused(dataset_b64: str) -> None:
    assert "input.steps: Input should be a valid integer" in refusal(minimal(dataset_b64, steps="2000"))


def test_boolean_sent_as_string_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, use_deepspeed="no"))

    assert "input.use_deepspeed: Input should be a valid boolean" in message


def test_not_a_number_learning_rate_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, learning_rate=float("nan")))

    assert "input.learning_rate: Input should be a finite number" in message


def test_learning_rate_above_1e_2_is_refused(dataset_b64: str) -> None:
    assert "input.learning_rate: Input should be less than or equal to 0.01" in refusal(
        minimal(dataset_b64, learning_rate=0.5)
    )


def test_unknown_mixed_precision_is_refused(dataset_b64: str) -> None:
    assert "input.mixed_precision: Input should be 'bf16', 'fp16' or 'no'" in refusal(
        minimal(dataset_b64, mixed_precision="fp8")
    )


@pytest.mark.parametrize(
    ("spelling", "name"), [("AdamW", "adamw"), ("adam-w", "adamw"), ("Lion", "lion"), ("adafactor", "adafactor")]
)
def test_optimizer_names_are_normalised(dataset_b64: str, spelling: str, name: str) -> None:
    assert parse_request(minimal(dataset_b64, optimizer=spelling)).optimizer == name


def test_unknown_optimizer_is_refused_with_the_supported_names(dataset_b64: str) -> None:
    assert "input.optimizer: is not supported; use one of adamw, adam, adagrad, lion, adafactor, sgd" in refusal(
        minimal(dataset_b64, optimizer="prodigy")
    )


def test_zero_stage_true_is_not_taken_for_stage_1(dataset_b64: str) -> None:
    assert "input.zero_stage: expected 'auto', 1, 2 or 3" in refusal(minimal(dataset_b64, zero_stage=True))


def test_blank_instance_prompt_is_refused(dataset_b64: str) -> None:
    assert "input.instance_prompt: must not be blank" in refusal(minimal(dataset_b64, instance_prompt="   "))


def test_overlong_instance_prompt_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, instance_prompt="x" * 2001))

    assert "input.instance_prompt: String should have at most 2000 characters" in message


def test_more_than_eight_validation_prompts_are_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, validation_prompts=["sks dog"] * 9))

    assert "input.validation_prompts: List should have at most 8 items" in message


def test_nested_list_error_names_the_item(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, validation_prompts=["ok", 3]))

    assert "input.validation_prompts[1]: Input should be a valid string" in message


def test_timeout_below_a_minute_is_refused(dataset_b64: str) -> None:
    assert "input.timeout_seconds: Input should be greater than or equal to 60" in refusal(
        minimal(dataset_b64, timeout_seconds=5)
    )


def test_every_failing_field_is_named_in_one_message(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, steps=-1, seed=-1, foo=1))

    assert message.startswith("invalid request: ")
    assert "input.steps:" in message
    assert "input.seed:" in message
    assert "input.foo: unknown field" in message


def test_message_stays_short_with_many_problems(dataset_b64: str) -> None:
    raw = minimal(dataset_b64, **{f"junk_{index}": index for index in range(50)})

    message = refusal(raw)

    assert "and 40 more" in message
    assert len(message) < 600


def test_message_never_echoes_the_dataset(dataset_b64: str) -> None:
    raw = minimal(dataset_b64 + "CANARYCANARY", steps=0)

    message = refusal(raw)

    assert "CANARY" not in message
    assert dataset_b64[:40] not in message


def test_message_never_echoes_a_wrongly_typed_dataset() -> None:
    message = refusal({"model_name": "m", "instance_prompt": "sks", "dataset": {"CANARY": "x" * 1000}})

    assert message == "invalid request: input.dataset: Input should be a valid string"


def test_repr_leaves_out_the_dataset_and_its_url(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64))
    by_url = parse_request({"model_name": "m", "instance_prompt": "sks", "dataset_url": "https://x.io/d?sig=CANARY"})

    assert dataset_b64[:40] not in repr(request)
    assert "CANARY" not in repr(by_url)


def test_refusal_writes_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)

    refusal({"model_name": "../../etc", "dataset": "!!", "instance_prompt": ""})

    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------- model_name


@pytest.mark.parametrize("name", ["../evil", "a/b", "a\\b", ".hidden", "-flag", "name\n", "a b"])
def test_model_name_with_path_characters_is_refused(dataset_b64: str, name: str) -> None:
    message = refusal(minimal(dataset_b64, model_name=name))

    assert "input.model_name: use letters, digits, '.', '_' and '-' only" in message


def test_model_name_with_double_dot_is_refused(dataset_b64: str) -> None:
    assert "input.model_name: must not contain '..'" in refusal(minimal(dataset_b64, model_name="a..b"))


def test_model_name_longer_than_64_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, model_name="m" * 65))

    assert "input.model_name: String should have at most 64 characters" in message


# --------------------------------------------------------------------------------- dataset, dataset_url


def test_dataset_and_dataset_url_together_are_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, dataset_url="https://example.com/d.zip"))

    assert "input.dataset, input.dataset_url: give exactly one of them" in message


def test_neither_dataset_nor_dataset_url_is_refused() -> None:
    message = refusal({"model_name": "m", "instance_prompt": "sks"})

    assert "input.dataset, input.dataset_url: give exactly one of them" in message


def test_empty_dataset_is_refused() -> None:
    message = refusal(minimal("data:application/zip;base64,"))

    assert "input.dataset: is empty" in message


@pytest.mark.parametrize("url", ["ftp://example.com/d.zip", "file:///etc/passwd", "gopher://x/d.zip"])
def test_dataset_url_other_than_http_is_refused(url: str) -> None:
    message = refusal({"model_name": "m", "instance_prompt": "sks", "dataset_url": url})

    assert "input.dataset_url: only http:// and https:// URLs are accepted" in message


def test_dataset_url_with_credentials_is_refused() -> None:
    message = refusal({"model_name": "m", "instance_prompt": "sks", "dataset_url": "https://user:pw@example.com/d.zip"})

    assert "input.dataset_url: must not carry credentials" in message
    assert "pw@" not in message


# --------------------------------------------------------------------------------------- base_model


@pytest.mark.parametrize("model", ["/runpod-volume/models/flux-dev", "black-forest-labs/FLUX.1-dev", TINY_MODEL_NAME])
def test_base_model_accepts_absolute_paths_hub_ids_and_the_tiny_model(dataset_b64: str, model: str) -> None:
    assert parse_request(minimal(dataset_b64, base_model=model)).base_model == model


@pytest.mark.parametrize("model", ["./models/flux", "flux", "~/flux", "org/../etc", "https://hf.co/x/y"])
def test_base_model_relative_or_odd_is_refused(dataset_b64: str, model: str) -> None:
    message = refusal(minimal(dataset_b64, base_model=model))

    assert "input.base_model: expected an absolute local path" in message


def test_base_model_absolute_path_with_parent_reference_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, base_model="/models/../etc/shadow"))

    assert "input.base_model: must not contain '..'" in message


# ------------------------------------------------------------------------------------- cross-field


def test_prior_preservation_without_class_prompt_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, with_prior_preservation=True))

    assert "input.class_prompt: required when input.with_prior_preservation is true" in message


def test_lora_settings_with_full_training_are_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, training_type="full", lora_rank=8, lora_alpha=8.0))

    assert "input.lora_rank, input.lora_alpha: only apply when input.training_type is 'lora'" in message


def test_lora_settings_with_lora_training_are_accepted(dataset_b64: str) -> None:
    request = parse_request(
        minimal(dataset_b64, training_type="lora", lora_rank=8, lora_target_modules=["to_q", "to_k"])
    )

    assert request.lora_target_modules == ["to_q", "to_k"]


def test_zero_stage_without_deepspeed_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, use_deepspeed=False, zero_stage=2))

    assert "input.zero_stage: need input.use_deepspeed true" in message


def test_lion_without_deepspeed_is_accepted_it_is_the_trainers_own_torch_optimizer(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, use_deepspeed=False, optimizer="Lion"))

    assert request.optimizer == "lion"


def test_offload_without_deepspeed_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, use_deepspeed=False, offload="cpu"))

    assert "input.offload: need input.use_deepspeed true" in message


def test_nvme_offload_below_stage_3_is_refused_saying_deepspeed_falls_back_to_ram(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, offload="nvme", zero_stage=2))

    assert "input.offload, input.zero_stage: 'nvme' offload needs ZeRO stage 3" in message
    assert "CPU RAM" in message


def test_nvme_offload_at_stage_3_is_accepted(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64, offload="nvme", zero_stage=3)).zero_stage == 3


def test_warmup_longer_than_the_run_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, steps=100, lr_warmup_steps=101))

    assert "input.lr_warmup_steps, input.steps: warmup (101) is longer than the run (100 steps)" in message


def test_validation_steps_with_validation_prompts_turned_off_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, validation_steps=100, validation_prompts=[]))

    assert message == (
        "invalid request: input.validation_steps: needs validation prompts (the prompts rendered every "
        "validation_steps steps), and input.validation_prompts [] turns them off; give prompts, leave "
        "validation_prompts out for the defaults, or remove validation_steps"
    )


def test_validation_steps_without_validation_prompts_renders_the_defaults(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, validation_steps=100))

    assert (request.validation_steps, request.validation_prompts) == (100, None)


def test_validation_steps_with_validation_prompts_is_accepted(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, steps=1000, validation_steps=250, validation_prompts=["sks dog"]))

    assert (request.validation_steps, request.warnings()) == (250, [])


def test_validation_steps_defaults_to_only_the_final_validation(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64, validation_prompts=["sks dog"])).validation_steps is None


def test_validation_steps_below_one_is_refused(dataset_b64: str) -> None:
    message = refusal(minimal(dataset_b64, validation_steps=0, validation_prompts=["sks dog"]))

    assert message == "invalid request: input.validation_steps: Input should be greater than or equal to 1"


def test_validation_steps_not_below_steps_is_accepted_with_a_warning(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, steps=100, validation_steps=100, validation_prompts=["sks dog"]))

    assert request.warnings() == [
        "validation_steps 100 is not below steps 100: validation images are rendered only at the end"
    ]


def test_request_model_refuses_directly_too(dataset_b64: str) -> None:
    with pytest.raises(ValueError, match="input.class_prompt: required"):
        TrainingRequest.model_validate(minimal(dataset_b64, with_prior_preservation=True))


# ---- defaults that train, and rates that suit the training type ---------------------------------------


def test_a_rate_that_suits_lora_gets_no_warning(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64, learning_rate=2e-4)).warnings() == []


def test_the_guides_full_fine_tune_rate_under_lora_is_used_with_a_warning(dataset_b64: str) -> None:
    request = parse_request(guide_basic_request(dataset_b64))

    assert (request.training_type, job_spec(request).optimisation.learning_rate) == ("lora", 2e-6)
    assert (
        "learning_rate 2e-06 is low for a LoRA (suitable: 1e-05 to 0.001); it is used as given — remove "
        "learning_rate to get the default 0.0001"
    ) in request.warnings()


def test_a_lora_rate_under_a_full_fine_tune_is_warned(dataset_b64: str) -> None:
    request = parse_request(minimal(dataset_b64, training_type="full", learning_rate=1e-4))

    assert request.warnings() == [
        "learning_rate 0.0001 is high for a full fine-tune (suitable: 1e-07 to 1e-05); it is used as given — "
        "remove learning_rate to get the default 2e-06"
    ]


@pytest.mark.parametrize("precision", ["fp8", "nf4"])
def test_a_quantised_base_with_a_full_fine_tune_is_refused(dataset_b64: str, precision: str) -> None:
    message = refusal(minimal(dataset_b64, training_type="full", base_precision=precision))

    assert (
        f"input.base_precision, input.training_type: '{precision}' stores a frozen, quantised base, and a full "
        "fine-tune trains every weight; use training_type 'lora' with it, or base_precision 'auto' or 'bf16'"
    ) in message


def test_an_unknown_base_precision_is_refused(dataset_b64: str) -> None:
    assert "input.base_precision: Input should be 'auto', 'bf16', 'fp8' or 'nf4'" in refusal(
        minimal(dataset_b64, base_precision="int8")
    )


def test_rates_of_optimizers_tuned_on_other_scales_get_no_warning(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64, optimizer="sgd", learning_rate=1e-2)).warnings() == []


# ---- fused_backward_pass ------------------------------------------------------------------------------------


def test_fused_backward_pass_defaults_to_the_planners_choice(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64, training_type="full")).fused_backward_pass == "auto"


def test_fused_backward_pass_true_is_accepted_for_a_full_fine_tune(dataset_b64: str) -> None:
    assert (
        parse_request(minimal(dataset_b64, training_type="full", fused_backward_pass=True)).fused_backward_pass is True
    )


def test_fused_backward_pass_under_lora_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, training_type="lora", fused_backward_pass=True)) == (
        "invalid request: input.fused_backward_pass: applies to training_type 'full' (it steps every weight of a "
        "full fine-tune inside the backward pass); remove it or set training_type 'full'"
    )


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {"gradient_accumulation_steps": 2},
            "input.fused_backward_pass, input.gradient_accumulation_steps: each weight is stepped as its gradient "
            "appears: no gradient buffer to accumulate in; use gradient_accumulation_steps 1",
        ),
        (
            {"optimizer": "AdamW"},
            "input.fused_backward_pass, input.optimizer: the fused pass steps with Adafactor; "
            "use optimizer 'adafactor' (or none)",
        ),
        (
            {"mixed_precision": "no"},
            "input.fused_backward_pass, input.mixed_precision: the fused pass trains bf16 weights; "
            "use mixed_precision 'bf16'",
        ),
        (
            {"offload": "cpu"},
            "input.fused_backward_pass, input.zero_stage, input.offload: the fused pass runs without DeepSpeed's "
            "ZeRO; use zero_stage and offload 'auto'",
        ),
    ],
)
def test_fused_backward_pass_true_with_a_setting_it_cannot_run_with_is_refused_naming_both(
    dataset_b64: str, fields: dict[str, Any], problem: str
) -> None:
    message = refusal(minimal(dataset_b64, training_type="full", fused_backward_pass=True, **fields))
    assert message == f"invalid request: {problem}"


def test_fused_backward_pass_as_a_string_other_than_auto_is_refused(dataset_b64: str) -> None:
    assert "input.fused_backward_pass" in refusal(minimal(dataset_b64, training_type="full", fused_backward_pass="yes"))


# ------------------------------------------------------------------- whole refusals (issue 29, item 5)


FUSED_ACCUMULATION_FP16 = {
    "training_type": "full",
    "fused_backward_pass": True,
    "gradient_accumulation_steps": 2,
    "mixed_precision": "fp16",
}


def test_a_refusal_naming_several_fields_names_every_one_whole(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, **FUSED_ACCUMULATION_FP16)) == (
        "invalid request: input.fused_backward_pass, input.gradient_accumulation_steps: each weight is stepped as its "
        "gradient appears: no gradient buffer to accumulate in; use gradient_accumulation_steps 1; "
        "input.fused_backward_pass, input.mixed_precision: the fused pass trains bf16 weights; use mixed_precision 'bf16'"
    )


def test_more_problems_than_are_listed_are_counted(dataset_b64: str) -> None:
    raw = {**minimal(dataset_b64), **{f"unknown_{index}": 1 for index in range(14)}}
    message = refusal(raw)
    assert message.count(": unknown field") == 10
    assert message.endswith("; and 4 more")


def test_an_unknown_fields_name_is_shown_escaped_and_bounded(dataset_b64: str) -> None:
    message = refusal({**minimal(dataset_b64), "bad\nname" + "x" * 5000: 1})
    assert "\n" not in message
    assert message.startswith("invalid request: input.bad\\nname") and message.endswith(": unknown field")
    assert len(message) < 200


def test_a_zero_stage_sent_as_a_float_is_refused_like_any_whole_number_field(dataset_b64: str) -> None:
    assert (
        refusal(minimal(dataset_b64, zero_stage=1.0)) == "invalid request: input.zero_stage: expected 'auto', 1, 2 or 3"
    )


@pytest.mark.parametrize("spelling", ["ada-factor", "Ada_Factor", "ADAFACTOR"])
def test_an_optimizer_name_ignores_case_dashes_and_underscores(dataset_b64: str, spelling: str) -> None:
    assert parse_request(minimal(dataset_b64, optimizer=spelling)).optimizer == "adafactor"


def test_the_learning_check_is_its_own_field_off_by_default(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64)).learning_check is False
    request = parse_request(minimal(dataset_b64, learning_check=True))
    assert (request.learning_check, request.debug) == (True, False)


def test_a_learning_check_that_is_not_a_boolean_names_the_field(dataset_b64: str) -> None:
    with pytest.raises(FluxboothError) as raised:
        parse_request(minimal(dataset_b64, learning_check="sometimes"))
    assert raised.value.code == ErrorCode.INVALID_INPUT and "learning_check" in raised.value.message


# ---- validation_images that can never be fetched are refused when the request is read (issue 37, item 13) -------


def with_validation_image(dataset_b64: str, image: str) -> dict[str, Any]:
    return minimal(dataset_b64, validation_prompts=["sks dog in the snow"], validation_images=[image])


@pytest.mark.parametrize(
    ("image", "why"),
    [
        ("file:///etc/passwd", "only http:// and https:// URLs are accepted"),
        ("FILE:/etc/passwd", "only http:// and https:// URLs are accepted"),
        ("ftp://example.com/control.png", "only http:// and https:// URLs are accepted"),
        (
            "http://169.254.169.254/latest/meta-data/",
            "names 169.254.169.254, a link-local (the cloud metadata range) "
            "address; the worker only downloads from public addresses",
        ),
        (
            "http://[::ffff:169.254.169.254]/x.png",
            "names ::ffff:a9fe:a9fe, a link-local (the cloud metadata range) "
            "address; the worker only downloads from public addresses",
        ),
        (
            "http://0.0.0.0:8080/x.png",
            "names 0.0.0.0, a unspecified address; the worker only downloads from public addresses",
        ),
        (
            "https://user:pw@example.com/x.png",
            "must not carry credentials (user:password@); use a presigned URL instead",
        ),
        ("/home/me/control.png", "is neither base64 image data (a `data:` prefix allowed) nor an http(s) URL"),
        ("C:\\photos\\control.png", "is neither base64 image data (a `data:` prefix allowed) nor an http(s) URL"),
    ],
)
def test_a_validation_image_that_can_never_be_fetched_is_invalid_input_naming_it(
    dataset_b64: str, image: str, why: str
) -> None:
    message = refusal(with_validation_image(dataset_b64, image))

    assert message == f"invalid request: input.validation_images: [0] {why}"


@pytest.mark.parametrize(
    "image",
    [
        "iVBORw0KGgo=",
        "data:image/png;base64,iVBORw0K\nGgo=",
        "https://example.com/control.png",
        "http://127.0.0.1:8000/control.png",  # loopback: allowed or refused by FLUXBOOTH_ALLOW_PRIVATE_URLS when fetched
    ],
)
def test_a_validation_image_that_may_be_fetched_is_accepted(dataset_b64: str, image: str) -> None:
    assert parse_request(with_validation_image(dataset_b64, image)).validation_images == [image.strip()]
