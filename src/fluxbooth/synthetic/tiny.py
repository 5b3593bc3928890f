"""A tiny, randomly initialised FLUX pipeline built on disk, fully offline.

Every component uses the class FLUX.1-dev uses (FluxTransformer2DModel with the guidance embedding,
AutoencoderKL with FLUX's 16 latent channels and 8x downsampling, CLIPTextModel, T5EncoderModel,
FlowMatchEulerDiscreteScheduler) with widths of a few dozen, so the whole folder is a few hundred KB
and a training step at 64x64 takes milliseconds on a CPU. The tokenizers are built here from a
byte-level alphabet, so nothing is ever downloaded.

`python -m fluxbooth.synthetic.tiny OUT_DIR` builds it (the worker calls this in a subprocess, because the
worker process must not import torch) and prints the folder's path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from fluxbooth.models.published_configs import FLUX1_DEV_SCHEDULER, FLUX1_VAE
from fluxbooth.synthetic.staging import build_in_place

# The components a FluxPipeline folder needs, each with the file that proves it was written.
REQUIRED_FILES = (
    "model_index.json",
    "scheduler/scheduler_config.json",
    "transformer/config.json",
    "transformer/diffusion_pytorch_model.safetensors",
    "vae/config.json",
    "vae/diffusion_pytorch_model.safetensors",
    "text_encoder/config.json",
    "text_encoder/model.safetensors",
    "tokenizer/tokenizer_config.json",
    "text_encoder_2/config.json",
    "text_encoder_2/model.safetensors",
    "tokenizer_2/tokenizer_config.json",
)

# Sizes. The transformer keeps FLUX's structure (double- and single-stream blocks, rotary axes that
# add up to the head dimension, guidance embedding); the VAE keeps FLUX's 8x downsampling and 16 latent
# channels so 64x64 images become 8x8 latents, i.e. 16 packed tokens.
TEXT_WIDTH = 32
T5_WIDTH = 32
LATENT_CHANNELS = 16
ATTENTION_HEAD_DIM = 16
ROPE_AXES = (4, 6, 6)
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512

TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": LATENT_CHANNELS * 4,
    "num_layers": 2,
    "num_single_layers": 2,
    "attention_head_dim": ATTENTION_HEAD_DIM,
    "num_attention_heads": 2,
    "joint_attention_dim": T5_WIDTH,
    "pooled_projection_dim": TEXT_WIDTH,
    "guidance_embeds": True,
    "axes_dims_rope": ROPE_AXES,
}

# How every tiny VAE narrows its family's published one (the tiny FLUX.2 preset reads it too).
TINY_VAE_NARROWING: dict[str, Any] = {
    "block_out_channels": [8, 8, 16, 16],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}
# FLUX.1-dev's VAE (its normalisation constants above all, so the trainer's latent normalisation path is the
# real one), narrowed.
VAE_CONFIG: dict[str, Any] = {**FLUX1_VAE, **TINY_VAE_NARROWING, "latent_channels": LATENT_CHANNELS}

# The text encoders' shapes; vocabulary sizes and special token ids come from the tokenizers.
CLIP_TEXT_CONFIG: dict[str, Any] = {
    "hidden_size": TEXT_WIDTH,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": CLIP_MAX_LENGTH,
    "projection_dim": TEXT_WIDTH,
    "hidden_act": "quick_gelu",
}
T5_CONFIG: dict[str, Any] = {
    "d_model": T5_WIDTH,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 2,
    "num_heads": 4,
    "relative_attention_num_buckets": 8,
    "feed_forward_proj": "gated-gelu",
    "dropout_rate": 0.0,
}

# FLUX.1-dev's scheduler configuration.
SCHEDULER_CONFIG: dict[str, Any] = dict(FLUX1_DEV_SCHEDULER)


def is_complete_pipeline(folder: Path) -> bool:
    """True when `folder` holds every file a FluxPipeline needs."""
    return all((folder / relative).is_file() for relative in REQUIRED_FILES)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable character table (byte-level BPE's alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(code) for code in characters), strict=True))


def _clip_vocabulary() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE vocabulary: every byte alone and word-final, a few merges, and CLIP's specials.

    With every byte in the vocabulary any text tokenises without an unknown token; the merges for
    common prompt words keep prompts short without making the file large.
    """
    alphabet = list(bytes_to_unicode().values())
    tokens = alphabet + [character + "</w>" for character in alphabet]
    merges: list[tuple[str, str]] = []
    for word in ("a", "photo", "of", "sks", "dog", "person", "the", "in", "on", "and"):
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            merged = pieces[0] + pieces[1]
            merge = (pieces[0], pieces[1])
            if merge not in merges:
                merges.append(merge)
            if merged not in tokens:
                tokens.append(merged)
            pieces = [merged] + pieces[2:]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {token: index for index, token in enumerate(tokens)}, merges


def _t5_vocabulary() -> list[tuple[str, float]]:
    """A Unigram vocabulary with T5's special tokens first (<pad>=0, </s>=1, <unk>=2) and then
    single characters, so any ASCII prompt tokenises; whole-word pieces get higher scores."""
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for word in ("a", "photo", "of", "sks", "dog", "person", "the", "in", "on", "and"):
        pieces.append(("▁" + word, -3.0))
    for code in range(33, 127):
        pieces.append((chr(code), -5.0))
        pieces.append(("▁" + chr(code), -4.5))
    unique: dict[str, float] = {}
    for piece, score in pieces:
        unique.setdefault(piece, score)
    return list(unique.items())


def build_tokenizers() -> dict[str, Any]:
    """{"tokenizer": the byte-level CLIPTokenizer, "tokenizer_2": the small T5TokenizerFast}."""
    # Deferred: reading this module's configs (the synthetic presets do) must not import torch, which transformers does.
    from transformers import CLIPTokenizer, T5TokenizerFast

    vocabulary, merges = _clip_vocabulary()
    return {
        "tokenizer": CLIPTokenizer(vocab=vocabulary, merges=merges, model_max_length=CLIP_MAX_LENGTH),
        "tokenizer_2": T5TokenizerFast(vocab=_t5_vocabulary(), extra_ids=0, model_max_length=T5_MAX_LENGTH),
    }


def text_encoder_configs(tokenizers: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(CLIPTextConfig kwargs, T5Config kwargs): the tiny shapes sized to `tokenizers`' vocabularies."""
    clip, t5 = tokenizers["tokenizer"], tokenizers["tokenizer_2"]
    clip_config = {
        **CLIP_TEXT_CONFIG,
        "vocab_size": len(clip),
        "bos_token_id": clip.bos_token_id,
        "eos_token_id": clip.eos_token_id,
        "pad_token_id": clip.pad_token_id,
    }
    t5_config = {
        **T5_CONFIG,
        "vocab_size": len(t5),
        "pad_token_id": t5.pad_token_id,
        "eos_token_id": t5.eos_token_id,
        "decoder_start_token_id": t5.pad_token_id,
    }
    return clip_config, t5_config


def _build_components(seed: int) -> dict[str, Any]:
    # Deferred: reading this module's configs (the synthetic presets do) must not import torch.
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizers = build_tokenizers()
    clip_config, t5_config = text_encoder_configs(tokenizers)

    # Each component gets its own seed offset so changing one component's shape never changes another's
    # weights; the whole folder is a pure function of `seed`.
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(**TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**VAE_CONFIG)
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**clip_config))
    torch.manual_seed(seed + 3)
    text_encoder_2 = T5EncoderModel(T5Config(**t5_config))
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    return {
        "scheduler": scheduler,
        "vae": vae.eval(),
        "text_encoder": text_encoder.eval(),
        "tokenizer": tokenizers["tokenizer"],
        "text_encoder_2": text_encoder_2.eval(),
        "tokenizer_2": tokenizers["tokenizer_2"],
        "transformer": transformer.eval(),
    }


def build_tiny_pipeline(out_dir: Path, seed: int = 0) -> Path:
    """Write a tiny FLUX pipeline to `out_dir` and return it; a complete folder already there is reused.

    The folder is written under a temporary name beside `out_dir` and renamed into place, so a reader
    never sees half a pipeline and concurrent builders cannot corrupt each other.
    """
    out_dir = Path(out_dir).absolute()
    if is_complete_pipeline(out_dir):
        return out_dir
    # Deferred: reading this module's configs (the synthetic presets do) must not import torch, which diffusers does.
    from diffusers import FluxPipeline

    def write(staging: Path) -> None:
        pipeline = FluxPipeline(**_build_components(seed))
        pipeline.save_pretrained(staging, safe_serialization=True)
        (staging / "fluxbooth_tiny.json").write_text(json.dumps({"seed": seed}, sort_keys=True) + "\n")
        if not is_complete_pipeline(staging):
            missing = [name for name in REQUIRED_FILES if not (staging / name).is_file()]
            raise RuntimeError(
                f"tiny pipeline build is missing {missing}; the installed diffusers may have changed its layout"
            )

    return build_in_place(out_dir, write, is_complete_pipeline)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fluxbooth.synthetic.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the pipeline to (reused when complete)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random weights")
    arguments = parser.parse_args(argv)
    path = build_tiny_pipeline(arguments.out_dir, seed=arguments.seed)
    print(path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
