"""The trigger word in captions and prompts (fluxbooth.contract.captions), and where the trainer puts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fluxbooth.contract.captions import with_trigger
from fluxbooth.request.model import parse_request
from fluxbooth.train.data import discover_images
from tests.support.factories import make_image
from tests.support.specs import job_spec


def test_a_caption_without_the_trigger_word_gets_it_in_front() -> None:
    assert with_trigger("a dog on a beach", "sks") == "sks a dog on a beach"


def test_a_caption_that_holds_the_trigger_word_is_kept_as_it_is() -> None:
    assert with_trigger("a photo of sks on a beach", "sks") == "a photo of sks on a beach"


def test_the_placeholder_is_replaced_by_the_trigger_word() -> None:
    assert with_trigger("a photo of [trigger], and [trigger] again", "sks") == "a photo of sks, and sks again"


def test_the_trigger_word_inside_another_word_does_not_count() -> None:
    assert with_trigger("TOKYO at night", "TOK") == "TOK TOKYO at night"


def test_the_trigger_word_is_matched_case_sensitively() -> None:
    assert with_trigger("a photo of Sks", "sks") == "sks a photo of Sks"


def test_an_empty_caption_becomes_the_trigger_word() -> None:
    assert with_trigger("", "sks") == "sks"


@pytest.mark.parametrize("trigger_word", [None, ""])
def test_without_a_trigger_word_the_text_is_unchanged(trigger_word: str | None) -> None:
    assert with_trigger("a photo of [trigger]", trigger_word) == "a photo of [trigger]"


def test_the_trainer_puts_the_trigger_word_into_captions_but_not_into_the_default_prompt(tmp_path: Path) -> None:
    for name in ("captioned", "uncaptioned"):
        make_image(tmp_path / f"{name}.png", size=(32, 32))
    (tmp_path / "captioned.txt").write_text("a dog on a beach\n", encoding="utf-8")

    images = discover_images(tmp_path, "sks a photo of a dog", trigger_word="sks")

    assert [(image.path.name, image.prompt) for image in images] == [
        ("captioned.png", "sks a dog on a beach"),
        ("uncaptioned.png", "sks a photo of a dog"),
    ]


def test_the_job_spec_puts_the_trigger_word_into_instance_and_validation_prompts_only() -> None:
    spec = job_spec(
        parse_request(
            {
                "model_name": "m",
                "dataset_url": "https://example.com/d.zip",
                "trigger_word": "sks",
                "instance_prompt": "a photo of a dog",
                "class_prompt": "a photo of a dog",
                "with_prior_preservation": True,
                "validation_prompts": ["[trigger] in the snow", "a painting"],
            }
        )
    )

    assert spec.prompts.instance_prompt == "sks a photo of a dog"
    assert spec.validation_prompts == ("sks in the snow", "sks a painting")
    assert spec.prompts.class_prompt == "a photo of a dog"
