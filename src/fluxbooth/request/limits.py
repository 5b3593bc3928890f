"""The request's defaults and limits (**contract**) that other packages read: the planner, the job spec and the
dataset checks take them from here, the request's fields (fluxbooth.request.fields) are declared with them."""

from __future__ import annotations

from typing import Literal

# LoRA by default: a rank-16 LoRA trains on 24, 48 and 80 GiB cards, while a full fine-tune of FLUX.1-dev with
# AdamW needs more host RAM for its offloaded optimizer states than any single-GPU RunPod tier has (the figure:
# fluxbooth.plan.full_finetune_host_bytes), and with Adafactor fused into the backward pass (bf16 weights) it
# needs a 48 or 80 GiB card.
DEFAULT_TRAINING_TYPE: Literal["full", "lora"] = "lora"
# The learning rate of a request that names none, by training type (the job spec fills it in).
DEFAULT_LEARNING_RATES = {"lora": 1e-4, "full": 2e-6}
# Learning rates that suit each training type (Adam-family optimizers): outside them an explicit rate is
# accepted with a warning. A LoRA's low-rank update starts at zero and needs 1e-5..1e-3 to move (diffusers'
# FLUX DreamBooth LoRA recipe: 1e-4); a full fine-tune moves 12 B pretrained weights and diverges above ~1e-5.
SUITABLE_LEARNING_RATES = {"lora": (1e-5, 1e-3), "full": (1e-7, 1e-5)}
ADAM_FAMILY = ("adamw", "adam")
MAX_PROMPT_CHARS = 2000
# Replicate's FLUX trainer defaults to it and ai-toolkit's FLUX examples set it (kohya and diffusers: 0): a few
# steps without a caption keep the subject from being tied to every word of the captions.
DEFAULT_CAPTION_DROPOUT = 0.05
MAX_TIMEOUT_SECONDS = 86_400

DatasetCheckMode = Literal["warn", "strict"]
