"""The captioner loaded and generating: a Qwen3-VL model, its tokenizer and image processor, on the GPU in bf16 or
the CPU in float32. The only module of fluxbooth.captions that imports torch (the captioning process loads it once
a model folder is found).

The model's inputs are built from the tokenizer and the image processor as Qwen3VLProcessor builds them (each
image's `<|image_pad|>` repeated once per merged patch, and the token types that mark them): transformers'
Qwen3VLProcessor cannot be made without torchvision (for its video half), which the image does not ship, and
captioning sends no video.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration

from fluxbooth.captions.prompt import caption_messages
from fluxbooth.captions.source import CaptionerUnavailable, cannot_load, first_line

MODEL_TYPE = "qwen3_vl"
IMAGE_TOKEN = "<|image_pad|>"
# Where some repos keep the chat template: the processor's legacy file, which the tokenizer does not read.
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"


@dataclass(frozen=True)
class Captioner:
    """A loaded captioner, ready to generate."""

    model: Any
    tokenizer: Any
    image_processor: Any
    chat_template: str
    image_token_id: int
    device: str
    dtype: Any


def pick_device(requested: str) -> str:
    """The device to run on: for "auto", CUDA when torch sees a device, else the CPU."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise CaptionerUnavailable("the captioner was asked to run on cuda, but torch sees no CUDA device")
    if requested not in ("cuda", "cpu"):
        raise CaptionerUnavailable(f"the captioner's device {requested!r} is none of auto, cuda and cpu")
    return requested


def _chat_template(folder: Path, tokenizer: Any) -> str | None:
    if isinstance(tokenizer.chat_template, str):
        return tokenizer.chat_template
    legacy = folder / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        template = json.loads(legacy.read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_captioner(name: str, folder: Path, device: str) -> Captioner:
    """The model, tokenizer and image processor in `folder`, on `device` (bf16 on CUDA, float32 on the CPU)."""
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError) as error:
        raise cannot_load(name, f"its config.json cannot be read ({first_line(error)})") from error
    if model_type != MODEL_TYPE:
        raise cannot_load(name, f"it is a {model_type} model, not Qwen3-VL ({MODEL_TYPE})")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        image_processor = AutoImageProcessor.from_pretrained(folder)
        model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    except Exception as error:  # any failure to load (missing or corrupt files, no memory) leaves it unavailable
        raise cannot_load(name, first_line(error)) from error
    template = _chat_template(folder, tokenizer)
    if template is None:
        raise cannot_load(name, "its tokenizer has no chat template")
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    if image_token_id != model.config.image_token_id:
        raise cannot_load(name, f"its tokenizer's {IMAGE_TOKEN} is not the model's image token")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Captioner(model, tokenizer, image_processor, template, int(image_token_id), device, dtype)


def model_inputs(captioner: Captioner, images: Sequence[Image.Image], prompt: str) -> dict[str, Any]:
    """One chat turn per image (the image, then `prompt`), left-padded for batched generation."""
    text = captioner.tokenizer.apply_chat_template(
        caption_messages(prompt), chat_template=captioner.chat_template, tokenize=False, add_generation_prompt=True
    )
    pixels = captioner.image_processor(images=list(images), return_tensors="pt")
    grids = pixels["image_grid_thw"]
    merged = captioner.image_processor.merge_size**2
    texts = [str(text).replace(IMAGE_TOKEN, IMAGE_TOKEN * (int(grid.prod()) // merged), 1) for grid in grids]
    encoded = captioner.tokenizer(texts, padding=True, padding_side="left", return_tensors="pt")
    input_ids = encoded["input_ids"]
    return {
        "input_ids": input_ids.to(captioner.device),
        "attention_mask": encoded["attention_mask"].to(captioner.device),
        # Qwen3-VL places its multimodal rotary positions by these: 1 marks an image token, 0 text.
        "mm_token_type_ids": (input_ids == captioner.image_token_id).long().to(captioner.device),
        "pixel_values": pixels["pixel_values"].to(captioner.device, captioner.dtype),
        "image_grid_thw": grids.to(captioner.device),
    }


def describe(captioner: Captioner, images: Sequence[Image.Image], prompt: str, max_new_tokens: int) -> list[str]:
    """The model's raw text for each image: greedy, only the new tokens, special tokens skipped."""
    inputs = model_inputs(captioner, images, prompt)
    with torch.inference_mode():
        generated = captioner.model.generate(
            **inputs,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=captioner.tokenizer.pad_token_id,
        )
    new_tokens = generated[:, inputs["input_ids"].shape[1] :]
    return [str(text) for text in captioner.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]
