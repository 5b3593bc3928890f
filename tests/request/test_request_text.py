"""The request's free text (fluxbooth.request.text): every prompt refuses control characters as the instance prompt
does, every text field needs one visible character, prompts and the trigger word are kept in NFC, and
keep_best_step needs more than one validation round."""

from __future__ import annotations

import unicodedata

import pytest

from fluxbooth.contract.captions import with_trigger
from tests.support.request_inputs import url_request, url_request_refusal
from tests.support.specs import job_spec

CONTROL = "contains a control character (NUL or another); send plain text"
# Characters that draw nothing: zero-width space, non-joiner, joiner, word joiner, byte-order mark, Hangul fillers,
# the Mongolian vowel separator and the braille blank.
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u3164", "\u115f", "\u1160", "\uffa0", "\u180e"]
CAFE_NFC = unicodedata.normalize("NFC", "café")
CAFE_NFD = unicodedata.normalize("NFD", "café")


request = url_request
refusal = url_request_refusal


@pytest.mark.parametrize("character", ["\x00", "\x1b", "\x07", "\x7f"])
def test_a_validation_prompt_with_a_control_character_is_refused_naming_its_position(character: str) -> None:
    assert refusal(validation_prompts=["a photo of sks dog", f"sks{character} dog"]) == (
        f"invalid request: input.validation_prompts: [1] {CONTROL}"
    )


@pytest.mark.parametrize("character", ["\x00", "\x1b", "\x07"])
def test_a_class_prompt_with_a_control_character_is_refused(character: str) -> None:
    assert refusal(class_prompt=f"a photo{character} of a dog") == f"invalid request: input.class_prompt: {CONTROL}"


def test_a_validation_prompt_over_two_lines_is_accepted() -> None:
    assert request(validation_prompts=["a photo of sks dog,\non a beach"]).validation_prompts == [
        "a photo of sks dog,\non a beach"
    ]


@pytest.mark.parametrize("character", INVISIBLE)
@pytest.mark.parametrize("field", ["instance_prompt", "class_prompt", "trigger_word", "resume_from"])
def test_a_text_field_of_invisible_characters_only_is_blank(field: str, character: str) -> None:
    assert refusal(**{field: f" {character}{character} "}) == f"invalid request: input.{field}: must not be blank"


@pytest.mark.parametrize("character", INVISIBLE)
def test_a_validation_prompt_of_invisible_characters_only_is_blank(character: str) -> None:
    assert refusal(validation_prompts=["a photo of sks dog", character]) == (
        "invalid request: input.validation_prompts: must not contain blank prompts"
    )


def test_a_dataset_of_a_zero_width_space_is_blank() -> None:
    assert refusal(dataset="\u200b", dataset_url=None) == "invalid request: input.dataset: must not be blank"


def test_a_prompt_with_one_visible_character_among_zero_width_ones_is_accepted() -> None:
    assert request(instance_prompt="\u200bx\u200b").instance_prompt == "\u200bx\u200b"


def test_prompts_and_the_trigger_word_are_kept_in_nfc() -> None:
    parsed = request(
        instance_prompt=f"a photo of {CAFE_NFD}",
        class_prompt=f"a photo of a {CAFE_NFD}",
        validation_prompts=[f"{CAFE_NFD} on a beach"],
        trigger_word=CAFE_NFD,
    )
    assert (parsed.instance_prompt, parsed.class_prompt, parsed.validation_prompts, parsed.trigger_word) == (
        f"a photo of {CAFE_NFC}",
        f"a photo of a {CAFE_NFC}",
        [f"{CAFE_NFC} on a beach"],
        CAFE_NFC,
    )


def test_an_nfc_trigger_word_in_an_nfd_prompt_is_found_not_added_twice() -> None:
    spec = job_spec(request(instance_prompt=f"a photo of {CAFE_NFD} dog", trigger_word=CAFE_NFC))
    assert spec.prompts.instance_prompt == f"a photo of {CAFE_NFC} dog"


def test_an_nfc_trigger_word_in_an_nfd_caption_is_found_not_added_twice() -> None:
    assert with_trigger(f"a photo of {CAFE_NFD} dog", CAFE_NFC) == f"a photo of {CAFE_NFC} dog"


def test_keep_best_step_with_validation_steps_at_steps_is_refused_as_one_round() -> None:
    assert refusal(keep_best_step=True, steps=500, validation_steps=500) == (
        "invalid request: input.keep_best_step, input.validation_steps: validation_steps 500 is not below steps 500, "
        "so the final step is the only validation round, nothing to choose between; set validation_steps below "
        "steps or remove keep_best_step"
    )


def test_keep_best_step_with_validation_steps_past_steps_is_refused_as_one_round() -> None:
    assert refusal(keep_best_step=True, steps=500, validation_steps=800).startswith(
        "invalid request: input.keep_best_step, input.validation_steps: validation_steps 800 is not below steps 500"
    )


def test_keep_best_step_with_two_validation_rounds_is_accepted() -> None:
    assert request(keep_best_step=True, steps=500, validation_steps=499).keep_best_step
