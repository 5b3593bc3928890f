"""The tiny captioner: Qwen3-VL's architecture with random weights, a few dozen wide, built offline and seeded.

Qwen3VLForConditionalGeneration from a Qwen3VLConfig that keeps what decides the shapes of its inputs (16-pixel
patches, 2x2 spatial merge, 2-frame temporal patches, the 48x48 grid of learned vision positions, DeepStack
features injected into the first text layers, interleaved multimodal rotary sections that add up to half the head)
and narrows the widths and depths; a byte-level tokenizer with Qwen's chat and vision special tokens and a Qwen3-VL
chat template; the image and video processors' configs as Qwen/Qwen3-VL-2B-Instruct publishes them. The folder is a
few hundred KB and loads with `from_pretrained` like the real model's, so the captioning process runs its real path
on it; its captions are noise.

The captioning process builds it in its own process (it imports torch already); the worker never does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fluxbooth.synthetic.chat_tokenizers import qwen_tokenizer
from fluxbooth.synthetic.staging import build_in_place, remove_abandoned_staging

# Qwen3-VL's vision special tokens, after the chat ones that qwen_tokenizer adds.
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
# Qwen3-VL's template for what a captioner sends: turns whose content is a string or a list of typed parts
# (each image or video a vision span, text as is), then the assistant's turn. It renders these messages as
# Qwen/Qwen3-VL-2B-Instruct's template does; tool calls and reasoning traces are left out.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' or 'video' in part %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Qwen/Qwen3-VL-2B-Instruct's vision and text configs (transformers' Qwen3VLConfig names), then the narrowing.
# patch_size, spatial_merge_size, temporal_patch_size and num_position_embeddings stay: they decide how many
# tokens an image becomes and how its positions are interpolated.
QWEN3_VL_2B_VISION: dict[str, Any] = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
    "initializer_range": 0.02,
}
QWEN3_VL_2B_TEXT: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
}
TINY_WIDTH = 32
TINY_VISION: dict[str, Any] = {
    **QWEN3_VL_2B_VISION,
    "depth": 2,
    "hidden_size": TINY_WIDTH,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": TINY_WIDTH,
    # One DeepStack feature, from the first block, as the real model takes three from its first 18.
    "deepstack_visual_indexes": [0],
}
TINY_TEXT: dict[str, Any] = {
    **QWEN3_VL_2B_TEXT,
    "hidden_size": TINY_WIDTH,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    # The temporal, height and width sections in about the real 24:20:20, adding up to half the head (8).
    "rope_parameters": {**QWEN3_VL_2B_TEXT["rope_parameters"], "mrope_section": [4, 2, 2]},
}
# The embedding table is the tokenizer's size rounded up to this, as the real table (151,936) is to 128.
VOCABULARY_MULTIPLE = 64

# Qwen/Qwen3-VL-2B-Instruct's preprocessor_config.json and video_preprocessor_config.json: at least 256x256 and at
# most 4096x4096 pixels an image, normalised to [-1, 1].
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
VIDEO_PROCESSOR_CONFIG: dict[str, Any] = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}

FOLDER_PREFIX = "tiny-captioner-seed"
MARKER_FILE = "fluxbooth_tiny_captioner.json"
# What a complete folder holds: the model, its generation defaults, the tokenizer and both processors' configs.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    MARKER_FILE,
)


def tiny_captioner_tokenizer() -> Any:
    """Qwen's byte-level tokenizer (fluxbooth.synthetic.chat_tokenizers) with the vision specials, Qwen3-VL's
    end of turn as its end token and chat template."""
    tokenizer = qwen_tokenizer(None)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": list(VISION_SPECIALS)}, replace_extra_special_tokens=False
    )
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    return tokenizer


def tiny_captioner_config(tokenizer: Any) -> Any:
    """The narrowed Qwen3VLConfig, its token ids the tokenizer's."""
    # Deferred: reading this module's configs must not import torch, which transformers' models do.
    from transformers import Qwen3VLConfig

    ids = tokenizer.convert_tokens_to_ids
    vocabulary = -(-len(tokenizer) // VOCABULARY_MULTIPLE) * VOCABULARY_MULTIPLE
    text = {
        **TINY_TEXT,
        "vocab_size": vocabulary,
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    return Qwen3VLConfig(
        text_config=text,
        vision_config=dict(TINY_VISION),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=TINY_TEXT["tie_word_embeddings"],
    )


def is_complete_captioner(folder: Path, seed: int) -> bool:
    marker = folder / MARKER_FILE
    if not all((folder / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        return bool(json.loads(marker.read_text()).get("seed") == seed)
    except (OSError, ValueError):
        return False


def _write_captioner(staging: Path, seed: int) -> None:
    # Deferred: see tiny_captioner_config.
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    tokenizer = tiny_captioner_tokenizer()
    config = tiny_captioner_config(tokenizer)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    ids = tokenizer.convert_tokens_to_ids
    # The real model's generation defaults sample; greedy here, and the captioner asks for greedy anyway.
    model.generation_config = GenerationConfig(
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=[ids("<|im_end|>"), ids("<|endoftext|>")],
        pad_token_id=ids("<|endoftext|>"),
        do_sample=False,
    )
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for name, values in (
        ("preprocessor_config.json", IMAGE_PROCESSOR_CONFIG),
        ("video_preprocessor_config.json", VIDEO_PROCESSOR_CONFIG),
        (MARKER_FILE, {"seed": seed}),
    ):
        (staging / name).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def build_tiny_captioner(out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny captioner to `out_dir` and return it; a complete folder of the same seed is reused.

    Written under a temporary name beside `out_dir` and renamed into place, as the tiny FLUX pipelines are
    (fluxbooth.synthetic.tiny): a reader never sees half a folder, and concurrent builders do not corrupt each other.
    """
    out_dir = Path(out_dir).absolute()
    if is_complete_captioner(out_dir, seed):
        return out_dir
    remove_abandoned_staging(out_dir)
    return build_in_place(
        out_dir, lambda staging: _write_captioner(staging, seed), lambda folder: is_complete_captioner(folder, seed)
    )


def ensure_tiny_captioner(cache_dir: Path, seed: int = 0) -> Path:
    """The tiny captioner of `seed` in `cache_dir`, built there once and reused after."""
    return build_tiny_captioner(Path(cache_dir) / f"{FOLDER_PREFIX}{seed}", seed=seed)
