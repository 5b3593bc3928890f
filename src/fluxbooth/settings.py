"""Worker settings, read once per job from the environment (never at import time)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TINY_MODEL_NAME = "fluxbooth/tiny-flux"
DEFAULT_BASE_MODEL = "black-forest-labs/FLUX.1-dev"

# Environment variables whose values must never reach a log, a result or a command line.
SECRET_ENV_NAMES = (
    "BUCKET_ACCESS_KEY_ID",
    "BUCKET_SECRET_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "RUNPOD_AI_API_KEY",
    "RUNPOD_API_KEY",
)


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(float(raw))
    except ValueError as error:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from error


def _count(environ: Mapping[str, str], name: str, default: int) -> int:
    """A whole number of things, 0 or more: "2.5" or "-1" is a mistake to report, not to round."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError as error:
        raise ValueError(f"environment variable {name}={raw!r} is not a whole number") from error
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must be 0 or more")
    return value


@dataclass(frozen=True)
class BucketSettings:
    """S3-compatible object storage, named as RunPod names it."""

    endpoint_url: str | None
    access_key_id: str
    secret_access_key: str
    bucket: str
    region: str
    prefix: str
    presign_seconds: int


@dataclass(frozen=True)
class DatasetLimits:
    max_base64_chars: int = 96 * 1024 * 1024
    max_download_bytes: int = 2 * 1024**3
    max_members: int = 5000
    max_expanded_bytes: int = 4 * 1024**3
    max_member_bytes: int = 256 * 1024**2
    max_compression_ratio: int = 200
    max_image_pixels: int = 50_000_000
    min_image_side: int = 64
    min_images: int = 3
    max_images: int = 1000
    download_timeout_seconds: int = 60
    allow_private_urls: bool = False


@dataclass(frozen=True)
class WorkerSettings:
    work_root: Path
    output_dir: Path
    cache_dir: Path
    default_base_model: str
    bucket: BucketSettings | None
    job_deadline_seconds: int
    volume_dir: Path | None
    # The module `accelerate launch` runs. Replaceable so a deployment can ship its own trainer
    # (and tests can launch fault-injecting ones) through the very same launcher.
    trainer_module: str = "fluxbooth.train"
    # Complete checkpoints kept per model in storage after each upload; 0 keeps every one.
    checkpoints_keep: int = 2
    dataset_limits: DatasetLimits = field(default_factory=DatasetLimits)
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def secret_values(self) -> list[str]:
        """Every secret value present in the environment, for redaction."""
        return [self.environ[name] for name in SECRET_ENV_NAMES if self.environ.get(name)]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        env = dict(os.environ if environ is None else environ)
        cache_home = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        bucket_name = env.get("BUCKET_NAME", "").strip()
        bucket = None
        if bucket_name:
            bucket = BucketSettings(
                endpoint_url=env.get("BUCKET_ENDPOINT_URL") or None,
                access_key_id=env.get("BUCKET_ACCESS_KEY_ID", ""),
                secret_access_key=env.get("BUCKET_SECRET_ACCESS_KEY", ""),
                bucket=bucket_name,
                region=env.get("BUCKET_REGION", "us-east-1"),
                prefix=env.get("BUCKET_PREFIX", "fluxbooth").strip("/"),
                presign_seconds=_int(env, "BUCKET_PRESIGN_SECONDS", 7 * 24 * 3600),
            )
        volume = env.get("FLUXBOOTH_VOLUME_DIR", "/runpod-volume")
        limits = DatasetLimits(
            max_base64_chars=_int(env, "FLUXBOOTH_MAX_BASE64_CHARS", DatasetLimits.max_base64_chars),
            max_download_bytes=_int(env, "FLUXBOOTH_MAX_DOWNLOAD_BYTES", DatasetLimits.max_download_bytes),
            max_expanded_bytes=_int(env, "FLUXBOOTH_MAX_EXPANDED_BYTES", DatasetLimits.max_expanded_bytes),
            max_image_pixels=_int(env, "FLUXBOOTH_MAX_IMAGE_PIXELS", DatasetLimits.max_image_pixels),
            min_image_side=_int(env, "FLUXBOOTH_MIN_IMAGE_SIDE", DatasetLimits.min_image_side),
            min_images=_int(env, "FLUXBOOTH_MIN_IMAGES", DatasetLimits.min_images),
            download_timeout_seconds=_int(
                env, "FLUXBOOTH_DOWNLOAD_TIMEOUT_SECONDS", DatasetLimits.download_timeout_seconds
            ),
            allow_private_urls=_flag(env.get("FLUXBOOTH_ALLOW_PRIVATE_URLS")),
        )
        return cls(
            work_root=Path(env.get("FLUXBOOTH_WORK_DIR") or Path(tempfile.gettempdir()) / "fluxbooth-jobs"),
            output_dir=Path(env.get("FLUXBOOTH_OUTPUT_DIR") or Path.cwd() / "outputs"),
            cache_dir=Path(env.get("FLUXBOOTH_CACHE_DIR") or cache_home / "fluxbooth"),
            default_base_model=env.get("FLUXBOOTH_BASE_MODEL") or DEFAULT_BASE_MODEL,
            bucket=bucket,
            job_deadline_seconds=_int(env, "FLUXBOOTH_JOB_DEADLINE_SECONDS", 3300),
            volume_dir=Path(volume) if volume and Path(volume).is_dir() else None,
            trainer_module=env.get("FLUXBOOTH_TRAINER_MODULE") or "fluxbooth.train",
            checkpoints_keep=_count(env, "FLUXBOOTH_CHECKPOINTS_KEEP", 2),
            dataset_limits=limits,
            environ=env,
        )
