"""Bake a base model into the image at build time: `python builder/fetch_model.py --model=REPO_ID
[--revision=REV] CACHE_DIR`; or the likeness scoring models (DINOv2, SigLIP) at their pinned revisions:
`python builder/fetch_model.py --scoring-models=FLAG CACHE_DIR`; or the default captioner (Qwen3-VL-2B-Instruct)
at its pinned revision: `python builder/fetch_model.py --caption-model=FLAG CACHE_DIR`. The Dockerfile passes its build arguments
as they are (`--model="$BASE_MODEL"`, `--scoring-models="$SCORING_MODELS"`), so this file, not the shell,
decides what they mean: an empty model bakes nothing, a flag takes the usual true/false spellings and anything
else fails the build, and a value given as `--model=VALUE` is never read as an option of its own.

The model lands in CACHE_DIR as a Hugging Face cache (`models--org--name/snapshots/<commit>/`), the layout
the worker looks for in the image's /models (FLUXBOOTH_BAKED_MODELS_DIR), so the job names it by its hub id.

Gated models (FLUX.1-dev) need HF_TOKEN, passed as a build secret, never as a build arg, so it is
not stored in an image layer. Only the diffusers components the trainer uses are fetched.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# The files the worker itself downloads (fluxbooth.models.source.PIPELINE_FILE_PATTERNS: every family's pipeline
# folders and file kinds). Written out because the model is baked before the source is copied into the image
# (a source change must not fetch the model again); tests/image/test_dockerfile.py checks that the two agree.
PIPELINE_FOLDERS = (
    "scheduler",
    "tokenizer",
    "tokenizer_2",
    "transformer",
    "vae",
    "text_encoder",
    "text_encoder_2",
)
FILE_KINDS = ("json", "safetensors", "txt", "model", "jinja")
COMPONENT_PATTERNS = ["model_index.json", *(f"{folder}/*.{kind}" for folder in PIPELINE_FOLDERS for kind in FILE_KINDS)]


# The scoring models at the revisions fluxbooth.likeness.weights pins (written out for the same reason as above;
# tests/image/test_dockerfile.py checks that the two agree): repository, commit, file patterns.
SCORING_MODELS = (
    ("facebook/dinov2-small", "ed25f3a31f01632728cabb09d1542f84ab7b0056", ("*.json", "model.safetensors")),
    (
        "google/siglip-base-patch16-224",
        "7fd15f0689c79d79e38b1c2e2e2370a7bf2761ed",
        ("*.json", "spiece.model", "model.safetensors"),
    ),
)


def fetch_scoring_models(
    target: Path, endpoint: str | None = None, models: tuple[tuple[str, str, tuple[str, ...]], ...] = SCORING_MODELS
) -> list[Path]:
    """Each scoring model's pinned revision into the cache `target` (the worker checks their sha256 on use)."""
    from huggingface_hub import snapshot_download

    return [
        Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=target, allow_patterns=list(patterns), endpoint=endpoint
            )
        )
        for repo_id, revision, patterns in models
    ]


# The default captioner at the revision fluxbooth.contract.captioning pins (written out for the same reason;
# tests/image/test_dockerfile.py checks that the two agree): repository, commit, file patterns.
CAPTION_MODEL = (
    "Qwen/Qwen3-VL-2B-Instruct",
    "89644892e4d85e24eaac8bacfd4f463576704203",
    ("*.json", "*.safetensors", "*.txt", "*.jinja"),
)


# The spellings a true/false build argument takes, compared without case.
TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off", "")
# A hub id as the worker's request takes it (fluxbooth.request.model), and a revision: a branch, tag or commit.
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
REVISION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")


class BuildArgumentError(ValueError):
    """A build argument the build cannot use; the message names it."""


def build_flag(name: str, value: str) -> bool:
    """The true/false build argument `name`: 1/0, true/false, yes/no, on/off in any case (empty: false)."""
    spelled = value.strip().lower()
    if spelled in TRUE_SPELLINGS:
        return True
    if spelled in FALSE_SPELLINGS:
        return False
    raise BuildArgumentError(f"{name}={value!r}: use 1/0, true/false, yes/no or on/off")


def base_model_to_bake(model: str, revision: str) -> tuple[str, str | None] | None:
    """(hub id, revision or None for the default branch) from BASE_MODEL and BASE_MODEL_REVISION; None when
    BASE_MODEL is empty (nothing to bake)."""
    if not model:
        if revision:
            raise BuildArgumentError(f"BASE_MODEL_REVISION={revision!r} needs BASE_MODEL, the hub id to bake")
        return None
    if not HUB_ID.fullmatch(model) or ".." in model:
        raise BuildArgumentError(f"BASE_MODEL={model!r}: expected a Hugging Face id, org/name")
    if revision and (not REVISION.fullmatch(revision) or ".." in revision):
        raise BuildArgumentError(f"BASE_MODEL_REVISION={revision!r}: expected a branch, tag or commit of {model}")
    return model, revision or None


def fetch(repo_id: str, target: Path, revision: str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    token_file = Path("/run/secrets/hf_token")
    token = token_file.read_text().strip() if token_file.is_file() else os.environ.get("HF_TOKEN")
    return Path(
        snapshot_download(repo_id, revision=revision, cache_dir=target, allow_patterns=COMPONENT_PATTERNS, token=token)
    )


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fetch_model.py", description="Bake models into the image's cache.")
    parser.add_argument("--model", default="", help="BASE_MODEL: a hub id; empty bakes nothing")
    parser.add_argument("--revision", default="", help="BASE_MODEL_REVISION: its branch, tag or commit")
    parser.add_argument("--scoring-models", default="0", help="SCORING_MODELS: 1/0, true/false, yes/no, on/off")
    parser.add_argument("--caption-model", default="0", help="CAPTION_MODEL: 1/0, true/false, yes/no, on/off")
    parser.add_argument("cache_dir", type=Path)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    arguments = parse_arguments(argv)
    try:
        scoring = build_flag("SCORING_MODELS", arguments.scoring_models)
        captioner = build_flag("CAPTION_MODEL", arguments.caption_model)
        model = base_model_to_bake(arguments.model, arguments.revision)
    except BuildArgumentError as error:
        print(f"fetch_model.py: {error}", file=sys.stderr)
        return 2
    if model is not None:
        repo_id, revision = model
        folder = fetch(repo_id, arguments.cache_dir, revision)
        # The snapshot folder is named by the commit baked: what an unset BASE_MODEL_REVISION resolved to.
        print(f"baked {repo_id} at commit {folder.name} ({revision or 'the default branch'}): {folder}")
    if scoring:
        print(*fetch_scoring_models(arguments.cache_dir), sep="\n")
    if captioner:
        print(*fetch_scoring_models(arguments.cache_dir, models=(CAPTION_MODEL,)), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
