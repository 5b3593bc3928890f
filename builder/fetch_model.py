"""Bake a base model into the image at build time: `python builder/fetch_model.py REPO_ID CACHE_DIR`; or the
likeness scoring models (DINOv2, SigLIP) at their pinned revisions: `python builder/fetch_model.py --scoring CACHE_DIR`.

The model lands in CACHE_DIR as a Hugging Face cache (`models--org--name/snapshots/<commit>/`), the layout
the worker looks for in the image's /models (FLUXBOOTH_BAKED_MODELS_DIR), so the job names it by its hub id.

Gated models (FLUX.1-dev) need HF_TOKEN, passed as a build secret, never as a build arg, so it is
not stored in an image layer. Only the diffusers components the trainer uses are fetched.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The files the worker itself downloads (fluxbooth.model_source.PIPELINE_FILE_PATTERNS: every family's pipeline
# folders and file kinds). Written out because the model is baked before the source is copied into the image
# (a source change must not fetch the model again); tests/test_dockerfile.py checks that the two agree.
PIPELINE_FOLDERS = (
    "scheduler", "tokenizer", "tokenizer_2", "transformer", "vae", "text_encoder", "text_encoder_2",
)
FILE_KINDS = ("json", "safetensors", "txt", "model", "jinja")
COMPONENT_PATTERNS = ["model_index.json", *(f"{folder}/*.{kind}" for folder in PIPELINE_FOLDERS for kind in FILE_KINDS)]


# The scoring models at the revisions fluxbooth.likeness.weights pins (written out for the same reason as above;
# tests/test_dockerfile.py checks that the two agree): repository, commit, file patterns.
SCORING_MODELS = (
    ("facebook/dinov2-small", "ed25f3a31f01632728cabb09d1542f84ab7b0056", ("*.json", "model.safetensors")),
    ("google/siglip-base-patch16-224", "7fd15f0689c79d79e38b1c2e2e2370a7bf2761ed", ("*.json", "spiece.model", "model.safetensors")),
)


def fetch_scoring_models(
    target: Path, endpoint: str | None = None, models: tuple[tuple[str, str, tuple[str, ...]], ...] = SCORING_MODELS
) -> list[Path]:
    """Each scoring model's pinned revision into the cache `target` (the worker checks their sha256 on use)."""
    from huggingface_hub import snapshot_download

    return [Path(snapshot_download(repo_id, revision=revision, cache_dir=target, allow_patterns=list(patterns), endpoint=endpoint))
            for repo_id, revision, patterns in models]


def fetch(repo_id: str, target: Path) -> Path:
    from huggingface_hub import snapshot_download

    token_file = Path("/run/secrets/hf_token")
    token = token_file.read_text().strip() if token_file.is_file() else os.environ.get("HF_TOKEN")
    return Path(snapshot_download(repo_id, cache_dir=target, allow_patterns=COMPONENT_PATTERNS, token=token))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: fetch_model.py REPO_ID CACHE_DIR | fetch_model.py --scoring CACHE_DIR")
    if sys.argv[1] == "--scoring":
        print(*fetch_scoring_models(Path(sys.argv[2])), sep="\n")
    else:
        print(fetch(sys.argv[1], Path(sys.argv[2])))
