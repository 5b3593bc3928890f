"""The request fields that shape what training sees: trigger word, caption dropout, aspect buckets,
timestep sampling, EMA and LoRA dropout. Each wrong value is `invalid_input` naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from fluxbooth.job.launch_files import trainer_config_for
from fluxbooth.request.model import parse_request
from tests.support.guide_job import GUIDE_DEFAULT_PLAN
from tests.support.request_inputs import minimal, refusal
from tests.support.specs import job_spec


@pytest.fixture(scope="module")
def dataset_b64() -> str:
    from tests.support.factories import make_dataset_zip, to_base64

    return to_base64(make_dataset_zip(count=3))


# ------------------------------------------------------------------------------------ trigger_word


def test_the_trigger_word_is_trimmed_and_reaches_the_trainer(dataset_b64: str, tmp_path: Path) -> None:
    request = parse_request(minimal(dataset_b64, trigger_word="  sks "))

    config = trainer_config_for(
        job_spec(request),
        GUIDE_DEFAULT_PLAN,
        base_model="/models/flux",
        instance_dir=tmp_path,
        class_dir=None,
        job_dir=tmp_path,
    )

    assert (request.trigger_word, config.prompts.trigger_word) == ("sks", "sks")


def test_no_trigger_word_by_default(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64)).trigger_word is None


def test_a_blank_trigger_word_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, trigger_word="  ")) == "invalid request: input.trigger_word: must not be blank"


def test_a_trigger_word_over_two_lines_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, trigger_word="sks\ndog")) == (
        "invalid request: input.trigger_word: must be one line, without newlines, line separators or other control "
        "characters"
    )


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_a_trigger_word_with_a_unicode_line_break_is_refused(dataset_b64: str, separator: str) -> None:
    assert refusal(minimal(dataset_b64, trigger_word=f"sks{separator}dog")) == (
        "invalid request: input.trigger_word: must be one line, without newlines, line separators or other control "
        "characters"
    )


def test_an_instance_prompt_with_a_nul_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, instance_prompt="a photo\x00 of sks dog")) == (
        "invalid request: input.instance_prompt: contains a control character (NUL or another); send plain text"
    )


def test_a_caption_dropout_of_1_warns_that_no_caption_is_trained_on(dataset_b64: str) -> None:
    assert any(
        warning.startswith("caption_dropout 1: every caption is dropped")
        for warning in parse_request(minimal(dataset_b64, caption_dropout=1)).warnings()
    )


def test_an_overlong_trigger_word_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, trigger_word="x" * 101)) == (
        "invalid request: input.trigger_word: String should have at most 100 characters"
    )


def test_a_trigger_word_that_is_not_a_string_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, trigger_word=7)) == (
        "invalid request: input.trigger_word: Input should be a valid string"
    )


def test_a_class_prompt_holding_the_trigger_word_is_warned_under_prior_preservation(dataset_b64: str) -> None:
    request = parse_request(
        minimal(dataset_b64, trigger_word="sks", class_prompt="a photo of sks dog", with_prior_preservation=True)
    )

    assert (
        "class_prompt contains the trigger word 'sks': prior preservation then teaches the class images as the "
        "subject; describe the class without it"
    ) in request.warnings()


# --------------------------------------------------------------------------------- caption_dropout


def test_caption_dropout_defaults_to_replicates_five_percent(dataset_b64: str) -> None:
    assert parse_request(minimal(dataset_b64)).caption_dropout == 0.05


@pytest.mark.parametrize("share", [0, 0.5, 1])
def test_caption_dropout_from_0_to_1_reaches_the_trainer(dataset_b64: str, tmp_path: Path, share: float) -> None:
    request = parse_request(minimal(dataset_b64, caption_dropout=share))

    config = trainer_config_for(
        job_spec(request),
        GUIDE_DEFAULT_PLAN,
        base_model="/models/flux",
        instance_dir=tmp_path,
        class_dir=None,
        job_dir=tmp_path,
    )

    assert config.prompts.caption_dropout == share


@pytest.mark.parametrize(
    ("share", "reason"),
    [
        (-0.1, "Input should be greater than or equal to 0"),
        (1.5, "Input should be less than or equal to 1"),
        ("0.1", "Input should be a valid number"),
        (True, "Input should be a valid number"),
    ],
)
def test_caption_dropout_outside_0_to_1_is_refused(dataset_b64: str, share: object, reason: str) -> None:
    assert refusal(minimal(dataset_b64, caption_dropout=share)) == f"invalid request: input.caption_dropout: {reason}"


# ------------------------------------------------------------------- timestep_sampling, EMA, LoRA dropout


def trainer_config(dataset_b64: str, tmp_path: Path, **fields: object) -> object:
    request = parse_request(minimal(dataset_b64, **fields))
    return trainer_config_for(
        job_spec(request),
        GUIDE_DEFAULT_PLAN,
        base_model="/models/flux",
        instance_dir=tmp_path,
        class_dir=None,
        job_dir=tmp_path,
    )


def test_sampling_ema_and_lora_dropout_keep_todays_training_by_default(dataset_b64: str, tmp_path: Path) -> None:
    config = trainer_config(dataset_b64, tmp_path)

    assert (config.optimisation.timestep_sampling, config.optimisation.ema_decay, config.lora.dropout) == (
        "uniform",
        None,
        0.0,
    )


def test_sampling_ema_and_lora_dropout_reach_the_trainer(dataset_b64: str, tmp_path: Path) -> None:
    config = trainer_config(dataset_b64, tmp_path, timestep_sampling="flux_shift", ema_decay=0.99, lora_dropout=0.1)

    assert (config.optimisation.timestep_sampling, config.optimisation.ema_decay, config.lora.dropout) == (
        "flux_shift",
        0.99,
        0.1,
    )


def test_an_unknown_timestep_sampling_is_refused_with_the_choices(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, timestep_sampling="sigma")) == (
        "invalid request: input.timestep_sampling: is not known; use one of uniform, sigmoid, logit_normal, mode, "
        "shift, flux_shift"
    )


@pytest.mark.parametrize(
    ("decay", "reason"),
    [
        (0, "Input should be greater than 0"),
        (1, "Input should be less than 1"),
        ("0.99", "Input should be a valid number"),
    ],
)
def test_an_ema_decay_outside_0_to_1_is_refused(dataset_b64: str, decay: object, reason: str) -> None:
    assert refusal(minimal(dataset_b64, ema_decay=decay)) == f"invalid request: input.ema_decay: {reason}"


def test_a_lora_dropout_of_1_is_refused(dataset_b64: str) -> None:
    assert (
        refusal(minimal(dataset_b64, lora_dropout=1))
        == "invalid request: input.lora_dropout: Input should be less than 1"
    )


def test_lora_dropout_with_a_full_fine_tune_is_refused(dataset_b64: str) -> None:
    assert refusal(minimal(dataset_b64, lora_dropout=0.1, training_type="full")) == (
        "invalid request: input.lora_dropout: only apply when input.training_type is 'lora'; remove them or set "
        "training_type 'lora'"
    )


def test_an_ema_is_planned_as_an_fp32_copy_of_the_trained_weights_in_host_ram(dataset_b64: str) -> None:
    from fluxbooth.host.hardware import GIB, hypothetical_hardware
    from fluxbooth.plan import Strategy, as_job, estimate_memory
    from fluxbooth.sizing import FLUX_DEV_NAME, model_size

    hardware = hypothetical_hardware(
        gpus=1, gpu_memory_bytes=80 * GIB, host_memory_bytes=256 * GIB, disk_bytes=500 * GIB
    )
    strategy, model = Strategy("lora", True, 2, "none", "none"), model_size(FLUX_DEV_NAME)

    estimate = estimate_memory(
        strategy, model, as_job(job_spec(parse_request(minimal(dataset_b64, ema_decay=0.99))), 10), hardware, "bf16"
    )

    assert estimate.breakdown["host.ema_shadow"] == 4 * estimate.breakdown["trainable_params"]
