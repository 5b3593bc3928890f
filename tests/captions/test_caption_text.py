"""A captioner's raw text finished by code (fluxbooth.captions.text): `"{trigger} {class noun}, {description}"`,
the model's preambles and subject phrase gone, and for a person the hair, eyes, skin, face, facial hair, age,
ethnicity and build the model described; clothing, pose, expression, setting, lighting and camera words kept."""

from __future__ import annotations

import unicodedata

import pytest

from fluxbooth.captions.text import MAX_DESCRIPTION_CHARS, finish_caption, identity_words_in
from fluxbooth.contract.captions import contains_word

# Qwen-style captions: (raw, class noun, subject type, the finished caption with trigger word "sks").
CAPTIONS = [
    (
        "The image shows a young Asian woman with long black hair smiling at the camera, wearing a red dress, "
        "standing in a park with soft natural light.",
        "woman",
        "person",
        "sks woman, smiling at the camera, wearing a red dress, standing in a park with soft natural light",
    ),
    (
        "A young woman with long brown hair is standing on a beach at sunset.",
        "woman",
        "person",
        "sks woman, standing on a beach at sunset",
    ),
    (
        "In this photo, a middle-aged man with a thick beard and short gray hair is sitting at a wooden desk, "
        "typing on a laptop.",
        "man",
        "person",
        "sks man, sitting at a wooden desk, typing on a laptop",
    ),
    (
        "This image depicts a smiling person wearing a navy blue hoodie, leaning against a brick wall in an urban "
        "alley.",
        "person",
        "person",
        "sks person, smiling, wearing a navy blue hoodie, leaning against a brick wall in an urban alley",
    ),
    (
        "The photograph captures a blonde, blue-eyed woman in her twenties laughing outdoors, with sunlight "
        "filtering through the trees.",
        "woman",
        "auto",
        "sks woman, laughing outdoors, with sunlight filtering through the trees",
    ),
    (
        "A close-up photo of a fair-skinned Caucasian man with green eyes and freckles, looking directly at the "
        "camera against a plain gray background.",
        "man",
        "person",
        "sks man, close-up photo, looking directly at the camera against a plain gray background",
    ),
    (
        "Here is a description of the image: A tall, slim Hispanic woman with curly dark hair pulled back, wearing "
        "a white blouse and jeans, walking down a city street.",
        "woman",
        "person",
        "sks woman, wearing a white blouse and jeans, walking down a city street",
    ),
    (
        "The image shows a 30-year-old man of Indian descent with a round face and a neatly trimmed beard, wearing "
        "glasses and a gray suit, standing in an office.",
        "man",
        "person",
        "sks man, wearing glasses and a gray suit, standing in an office",
    ),
    (
        "A woman, who appears to be in her early thirties, with dark skin and braids, sits on a bench reading a book.",
        "woman",
        "person",
        "sks woman, sits on a bench reading a book",
    ),
    (
        "An athletic African American man with a shaved head is jogging along a river path in the early morning light.",
        "man",
        "person",
        "sks man, jogging along a river path in the early morning light",
    ),
    (
        "A black and white portrait of an elderly woman with wrinkles and short white hair, sitting by a window.",
        "woman",
        "person",
        "sks woman, black and white portrait, sitting by a window",
    ),
    (
        "Sure! Here is a caption: The photo shows a curly-haired boy in a yellow raincoat jumping in a puddle.",
        "boy",
        "person",
        "sks boy, in a yellow raincoat jumping in a puddle",
    ),
    (
        "In the image, the subject is wearing a black leather jacket and sunglasses, posing in front of a graffiti "
        "wall.",
        "person",
        "person",
        "sks person, wearing a black leather jacket and sunglasses, posing in front of a graffiti wall",
    ),
    (
        "The image features a golden retriever with long golden fur sitting on green grass in a sunny backyard.",
        "dog",
        "pet",
        "sks dog, with long golden fur sitting on green grass in a sunny backyard",
    ),
    (
        "In the image, there is a fluffy white kitten sleeping on a blue blanket.",
        "cat",
        "pet",
        "sks cat, sleeping on a blue blanket",
    ),
    (
        "This is a picture of a ceramic mug with a blue glaze on a wooden table, next to a young plant.",
        "mug",
        "object",
        "sks mug, with a blue glaze on a wooden table, next to a young plant",
    ),
    (
        "This image depicts a red sneaker on a white background, studio lighting.",
        "sneaker",
        "object",
        "sks sneaker, on a white background, studio lighting",
    ),
    (
        "**A young woman** smiling at the camera.",
        "woman",
        "person",
        "sks woman, smiling at the camera",
    ),
    (
        "The image shows a young woman. She has long brown hair and is wearing a red dress. The background is a "
        "sunset.",
        "woman",
        "person",
        "sks woman, wearing a red dress. The background is a sunset",
    ),
]
RAW_CAPTIONS = [(raw, noun, subject_type) for raw, noun, subject_type, _ in CAPTIONS]


def finished(
    raw: str, class_noun: str = "woman", subject_type: str = "person", trigger_word: str | None = "sks"
) -> str:
    """The finished caption, checked on the way for what every caption must hold: the trigger word first, found
    by `contains_word` (so every example below tests it)."""
    caption = finish_caption(raw, trigger_word=trigger_word, class_noun=class_noun, subject_type=subject_type)
    if trigger_word:
        assert caption.startswith(unicodedata.normalize("NFC", trigger_word) + " ")
        assert contains_word(caption, trigger_word)
    return caption


@pytest.mark.parametrize(("raw", "class_noun", "subject_type", "expected"), CAPTIONS)
def test_a_caption_is_the_trigger_the_class_noun_and_the_models_description_cleaned(
    raw: str, class_noun: str, subject_type: str, expected: str
) -> None:
    assert finished(raw, class_noun, subject_type) == expected


@pytest.mark.parametrize(("raw", "class_noun", "subject_type"), RAW_CAPTIONS)
def test_the_trigger_word_comes_first_and_contains_word_finds_it(raw: str, class_noun: str, subject_type: str) -> None:
    caption = finished(raw, class_noun, subject_type)
    assert caption.startswith(f"sks {class_noun}")
    assert contains_word(caption, "sks")


def test_a_person_caption_naming_hair_colour_and_ethnicity_loses_them() -> None:
    assert finished("A Hispanic woman with red hair reading in a cafe.") == "sks woman, reading in a cafe"
    assert finished("A smiling woman of Korean descent with wavy auburn hair, holding a coffee cup.") == (
        "sks woman, smiling, holding a coffee cup"
    )


def test_the_colour_in_a_pets_subject_phrase_goes_with_the_phrase_but_a_colour_elsewhere_stays() -> None:
    assert finished("A brown dog lying on a sofa next to a brown cushion.", "dog", "pet") == (
        "sks dog, lying on a sofa next to a brown cushion"
    )


def test_pets_and_objects_keep_the_words_a_person_would_lose() -> None:
    assert finished("A puppy with long golden hair and blue eyes playing in the snow.", "dog", "pet") == (
        "sks dog, with long golden hair and blue eyes playing in the snow"
    )
    assert finished("A vintage camera next to a young plant and a slim notebook.", "camera", "object") == (
        "sks camera, next to a young plant and a slim notebook"
    )


def test_auto_filters_identity_words_as_for_a_person() -> None:
    assert finished("A golden retriever with long golden hair running on a beach.", "dog", "auto") == (
        "sks dog, running on a beach"
    )


def test_facial_hair_is_identity_for_a_person() -> None:
    assert finished("A bearded man with a thick mustache and stubble, wearing a denim jacket.", "man") == (
        "sks man, wearing a denim jacket"
    )
    assert finished("A clean-shaven man in a suit.", "man") == "sks man, in a suit"


def test_a_pose_of_the_eyes_and_hair_words_without_a_look_stay() -> None:
    assert finished("A smiling woman with her eyes closed, her long brown hair blowing in the wind.") == (
        "sks woman, smiling, with her eyes closed, her hair blowing in the wind"
    )


def test_age_and_build_words_that_also_describe_things_go_only_before_a_person_noun() -> None:
    assert finished("A man standing next to a tall woman, wearing a tall hat, by an old car.", "man") == (
        "sks man, standing next to a woman, wearing a tall hat, by an old car"
    )


def test_an_article_left_before_the_wrong_sound_is_repaired() -> None:
    assert finished("The image shows a man walking next to an elderly woman on a snowy street.", "man") == (
        "sks man, walking next to a woman on a snowy street"
    )


def test_nationality_words_naming_clothing_or_places_stay() -> None:
    assert finished("A woman wearing a traditional Indian saree in front of a Japanese garden.") == (
        "sks woman, wearing a traditional Indian saree in front of a Japanese garden"
    )


def test_only_an_expression_adjective_of_the_subject_phrase_stays() -> None:
    assert finished("A happy young woman sitting on a bench.") == "sks woman, happy, sitting on a bench"


def test_the_framing_words_of_a_preamble_stay_first() -> None:
    assert finished("The photo is a close-up of a dog's face.", "dog", "pet") == "sks dog, close-up, a dog's face"
    assert finished('"A DSLR photo of a man hiking."', "man") == "sks man, DSLR photo, hiking"


@pytest.mark.parametrize(
    ("raw", "class_noun", "subject_type", "expected"),
    [
        ("A dog bed in a sunny room.", "dog", "pet", "sks dog, a dog bed in a sunny room"),
        ("A man's hand holding a ceramic mug of coffee.", "mug", "object", "sks mug, a man's hand holding a ceramic mug of coffee"),
        ("A teddy bear sitting on a shelf.", "teddy bear", "object", "sks teddy bear, sitting on a shelf"),
        ("Standing in a kitchen, a young woman chops vegetables.", "woman", "person", "sks woman, standing in a kitchen, a woman chops vegetables"),
    ],
)  # fmt: skip
def test_only_a_leading_subject_phrase_the_sentence_goes_on_from_is_replaced(
    raw: str, class_noun: str, subject_type: str, expected: str
) -> None:
    assert finished(raw, class_noun, subject_type) == expected


def test_a_dangling_with_goes_but_a_leading_with_phrase_stays() -> None:
    assert finished("A woman with long blonde hair, wearing a yellow coat.") == "sks woman, wearing a yellow coat"
    assert finished("A dog with a red collar lying on grass.", "dog", "pet") == (
        "sks dog, with a red collar lying on grass"
    )


def test_the_commas_and_connectors_removals_leave_are_tidied() -> None:
    assert finished("A woman with, smiling and , ,standing .") == "sks woman, smiling, standing"


@pytest.mark.parametrize("trigger_word", [None, ""])
def test_without_a_trigger_word_the_class_noun_leads(trigger_word: str | None) -> None:
    caption = finished("A young woman with long brown hair is reading a book.", trigger_word=trigger_word)
    assert caption == "woman, reading a book"


@pytest.mark.parametrize("raw", ["", "   ", "\n\t "])
def test_an_empty_caption_is_the_subject_alone(raw: str) -> None:
    assert finished(raw) == "sks woman"


@pytest.mark.parametrize("raw", ["The image shows", "Here is a caption:", "A photo of a woman.", "A young woman."])
def test_a_caption_that_is_only_a_preamble_or_the_subject_is_the_subject_alone(raw: str) -> None:
    assert finished(raw) == "sks woman"


def test_the_description_is_cut_at_a_word_within_the_cap() -> None:
    scene, clause = "standing in a meadow at golden hour", "surrounded by butterflies and tall grass"
    description = finished(f"A woman {scene}, " + ", ".join([clause] * 9)).removeprefix("sks woman, ")
    # 35 + 6 × 42 = 287 characters, then ", surrounded" ends at 299 and " by" would end at 302.
    assert description == f"{scene}, " + ", ".join([clause] * 6) + ", surrounded"
    assert len(description) <= MAX_DESCRIPTION_CHARS


def test_a_decomposed_trigger_word_is_found_in_the_nfc_caption() -> None:
    trigger = unicodedata.normalize("NFD", "Zoë")
    raw = unicodedata.normalize("NFD", "The image shows a woman sitting in a café.")
    caption = finished(raw, trigger_word=trigger)
    assert caption == unicodedata.normalize("NFC", "Zoë woman, sitting in a café")
    assert contains_word(caption, trigger)


def test_an_unknown_subject_type_is_refused() -> None:
    with pytest.raises(ValueError, match="subject_type"):
        finished("A woman.", subject_type="people")


def test_identity_words_in_lists_the_deny_list_hits_in_order() -> None:
    text = "A young Latina woman with wavy brown hair, green eyes and a round face, wearing a white dress."
    assert identity_words_in(text) == ["young", "Latina", "with wavy brown hair", "green eyes", "and a round face"]
    assert identity_words_in("A woman in a white dress on a tall ladder.") == []
