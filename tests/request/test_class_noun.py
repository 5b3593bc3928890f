"""The class noun the default validation prompts and prompt fidelity use (fluxbooth.request.class_noun): the noun
after the article in a class prompt that prior preservation uses, else the noun after the trigger word in the
instance prompt (with `[trigger]` replaced first), else the subject type's."""

from __future__ import annotations

from typing import Any

import pytest

from fluxbooth.request.model import TrainingRequest, parse_request
from tests.support.specs import job_spec


def request(**fields: Any) -> TrainingRequest:
    return parse_request({"model_name": "m", "dataset_url": "https://example.com/d.zip", **fields})


def noun(**fields: Any) -> str:
    return job_spec(request(**fields)).class_noun


def with_prior(class_prompt: str, **fields: Any) -> str:
    return noun(instance_prompt="TOK", with_prior_preservation=True, class_prompt=class_prompt, **fields)


@pytest.mark.parametrize(
    ("class_prompt", "expected"),
    [
        ("a photo of a dog in the park", "dog"),
        ("a photo of a dog", "dog"),
        ("a photo of a Golden Retriever, high quality", "retriever"),
        ("A PHOTO OF A CAT", "cat"),
        ("an image of an old car parked on the street", "car"),
        ("a close-up photo of a woman wearing a hat", "woman"),
        ("a photo of a smiling man", "man"),
        ("a photo of a dog sitting on a couch", "dog"),
        ("a photo of a dog and a cat", "dog"),
        ("a portrait of my grandmother by the window", "grandmother"),
        ("a dog", "dog"),
        ("dog", "dog"),
        ("photo of the red sneaker, studio lighting", "sneaker"),
        ("a DSLR photograph of a teddy bear with a bow", "bear"),
        ("a photo of dogs at the beach", "dogs"),
        ("a painting of a lighthouse near the sea", "lighthouse"),
    ],
)
def test_the_class_prompt_names_the_noun_after_its_article(class_prompt: str, expected: str) -> None:
    assert with_prior(class_prompt) == expected


def test_a_trigger_placeholder_in_the_class_prompt_is_not_the_noun() -> None:
    assert with_prior("a photo of a [trigger] dog", trigger_word="sks") == "dog"


@pytest.mark.parametrize(
    ("instance_prompt", "expected"),
    [
        ("a photo of [trigger] dog", "dog"),
        ("a photo of sks dog", "dog"),
        ("a photo of sks golden retriever in the park", "retriever"),
        ("sks cat, high quality", "cat"),
        ("a photo of sks woman wearing glasses", "woman"),
        ("[trigger] sneaker", "sneaker"),
    ],
)
def test_the_instance_prompt_names_the_noun_after_the_trigger_word(instance_prompt: str, expected: str) -> None:
    assert noun(instance_prompt=instance_prompt, trigger_word="sks") == expected


@pytest.mark.parametrize("instance_prompt", ["a photo of sks", "a photo of sks in the park", "sks, on a beach"])
def test_nothing_after_the_trigger_word_leaves_the_subject_types_noun(instance_prompt: str) -> None:
    assert noun(instance_prompt=instance_prompt, trigger_word="sks", subject_type="pet") == "pet"


def test_the_default_prompts_of_a_trigger_placeholder_name_the_noun_after_it() -> None:
    spec = job_spec(request(instance_prompt="a photo of [trigger] dog", trigger_word="sks"))
    assert spec.validation_prompts[1] == "a photo of sks dog, on a beach at sunset"


def test_the_default_prompts_of_a_class_prompt_with_a_place_name_the_subject_not_the_place() -> None:
    spec = job_spec(
        request(
            instance_prompt="TOK",
            trigger_word="TOK",
            with_prior_preservation=True,
            class_prompt="a photo of a dog in the park",
        )
    )
    assert spec.validation_prompts[1] == "a photo of TOK dog, on a beach at sunset"


def test_a_class_prompt_ignored_without_prior_preservation_does_not_rename_the_subject() -> None:
    assert noun(instance_prompt="a photo of sks dog", trigger_word="sks", class_prompt="a photo of a cat") == "dog"


def test_a_class_prompt_ignored_without_prior_preservation_leaves_the_subject_types_noun() -> None:
    assert noun(instance_prompt="TOK", class_prompt="a photo of a cat", subject_type="object") == "object"


def test_a_class_prompt_prior_preservation_uses_comes_before_the_word_after_the_trigger() -> None:
    assert with_prior("a photo of a puppy", trigger_word="TOK") == "puppy"
