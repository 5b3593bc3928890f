"""What the captioner is asked, per subject type, and the one chat turn that asks it. Pure Python, no torch.

A training caption should name what changes from photo to photo (pose, framing, clothes, setting, light, shot) and
leave out what the trigger word is meant to learn: for a person, the identity (face, hair, eyes, skin, age, ethnicity,
build), so the LoRA ties those to the trigger word rather than to words in the caption. A pet's or an object's colour
and breed may be said. Whatever the model writes anyway is taken out by fluxbooth.captions.text.
"""

from __future__ import annotations

from typing import Any

_ASK = "Describe this photo in one or two plain sentences: "
_TAIL = (
    " Write only the description, with no preamble, no list and no mention of the photo itself as an image "
    "or a picture."
)
PERSON_PROMPT = (
    _ASK + "the person's pose, how the shot frames them, their clothing, their expression, the setting, the "
    "lighting and the camera angle or shot type (close-up, portrait, full-body, ...). Do not mention their face "
    "shape, hair, eye colour, skin colour, age, ethnicity or body shape." + _TAIL
)
PET_PROMPT = (
    _ASK + "the animal's pose, how the shot frames it, its colour and breed, anything it wears, its expression, "
    "the setting, the lighting and the camera angle or shot type (close-up, portrait, full-body, ...)." + _TAIL
)
OBJECT_PROMPT = (
    _ASK + "the object's position, how the shot frames it, its colour and material, the setting, the lighting "
    "and the camera angle or shot type (close-up, overhead, product shot, ...)." + _TAIL
)
# subject_type "auto" (and any type not named here) asks the person's prompt: it describes a pet or an object
# well enough, and never asks a person's photo for identity words.
PROMPTS = {"person": PERSON_PROMPT, "pet": PET_PROMPT, "object": OBJECT_PROMPT}


def caption_prompt(subject_type: str) -> str:
    """The instruction for photos of `subject_type`."""
    return PROMPTS.get(subject_type, PERSON_PROMPT)


def caption_messages(prompt: str) -> list[dict[str, Any]]:
    """One user turn: the photo, then the instruction (the order Qwen-VL's model cards use)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
