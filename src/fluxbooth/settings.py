"""Worker settings, read once per job from the environment (never at import time)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from fluxbooth.contract.captioning import CAPTION_MODEL_VARIABLE, DEFAULT_CAPTION_MODEL

TINY_MODEL_NAME = "fluxbooth/tiny-flux"
DEFAULT_BASE_MODEL = "black-forest-labs/FLUX.1-dev"
# RunPod ends a job at its endpoint's execution timeout, 600 s unless the endpoint sets another, with no result.
# The worker's own deadline stays a minute under it, so its `timeout` result (with the work kept) gets out first.
# One rule for the image and the Hub (.runpod/hub.json): raise both together for longer jobs.
RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS = 600
DEADLINE_BELOW_EXECUTION_TIMEOUT_SECONDS = 60
DEFAULT_JOB_DEADLINE_SECONDS = RUNPOD_DEFAULT_EXECUTION_TIMEOUT_SECONDS - DEADLINE_BELOW_EXECUTION_TIMEOUT_SECONDS
# The base model's download (Hugging Face to the worker) and the artifacts' upload (the worker to the bucket), for
# the plan's `download` and `upload` phases: stated guesses, not measured (no RunPod worker here); set
# FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND / FLUXBOOTH_UPLOAD_BYTES_PER_SECOND to what a worker really gets.
DEFAULT_DOWNLOAD_BYTES_PER_SECOND = 100e6
DEFAULT_UPLOAD_BYTES_PER_SECOND = 50e6

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


def _finite(environ: Mapping[str, str], name: str) -> float | None:
    """A finite number like "2", "2.5" or "100e6"; None when unset. `inf`, `nan` and values that overflow a float
    ("1e400") are a ValueError naming the variable, never an OverflowError out of int()."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError as error:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from error
    if not math.isfinite(value):
        raise ValueError(f"environment variable {name}={raw!r} is not a finite number")
    return value


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = _finite(environ, name)
    return default if value is None else int(value)


def _at_least(environ: Mapping[str, str], name: str, default: float, minimum: float, expected: str) -> float:
    """A finite number, `minimum` or more; `expected` completes "must be …"."""
    value = _finite(environ, name)
    if value is None:
        return default
    if value < minimum:
        raise ValueError(f"environment variable {name}={environ[name]!r} must be {expected}")
    return value


def _deadline_seconds(environ: Mapping[str, str], name: str, default: int) -> int:
    """Whole seconds, at least one: a deadline of 0, below zero or under a second leaves no job any time."""
    return int(_at_least(environ, name, default, 1, "1 second or more"))


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


def _ratio(environ: Mapping[str, str], name: str, default: float) -> float:
    """A proportion like "4" or "2.5" (to 1), at least 1."""
    return _at_least(environ, name, default, 1, "1 or more")


def _positive_number(environ: Mapping[str, str], name: str, expected: str) -> float | None:
    """A finite number above 0, like "0.69" or "100e6"; None when unset. `expected` completes "must be …"."""
    value = _finite(environ, name)
    if value is not None and value <= 0:
        raise ValueError(f"environment variable {name}={environ[name]!r} must be {expected}")
    return value


def _price(environ: Mapping[str, str], name: str) -> float | None:
    """A price like "0.69" (per hour of one worker), more than 0; None when unset."""
    return _positive_number(environ, name, "a price above 0, like 0.69")


def _bytes_per_second(environ: Mapping[str, str], name: str, default: float) -> float:
    """A transfer rate in bytes per second, like "100e6", above 0."""
    rate = _positive_number(environ, name, "bytes per second above 0, like 100e6")
    return default if rate is None else rate


@dataclass(frozen=True)
class TransferRates:
    """How fast the worker downloads the base model and uploads the artifacts (the plan's network phases)."""

    download_bytes_per_second: float = DEFAULT_DOWNLOAD_BYTES_PER_SECOND
    upload_bytes_per_second: float = DEFAULT_UPLOAD_BYTES_PER_SECOND

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> TransferRates:
        return cls(
            download_bytes_per_second=_bytes_per_second(
                environ, "FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND", DEFAULT_DOWNLOAD_BYTES_PER_SECOND
            ),
            upload_bytes_per_second=_bytes_per_second(
                environ, "FLUXBOOTH_UPLOAD_BYTES_PER_SECOND", DEFAULT_UPLOAD_BYTES_PER_SECOND
            ),
        )


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


# Set by RunPod inside its pods and serverless workers.
RUNPOD_PRESENCE_VARIABLES = ("RUNPOD_POD_ID", "RUNPOD_ENDPOINT_ID")
ALLOW_LOCAL_OUTPUT_VARIABLE = "FLUXBOOTH_ALLOW_LOCAL_OUTPUT"
PRICE_VARIABLE = "FLUXBOOTH_PRICE_PER_HOUR"
BUCKET_VARIABLES = ("BUCKET_ENDPOINT_URL", "BUCKET_ACCESS_KEY_ID", "BUCKET_SECRET_ACCESS_KEY", "BUCKET_NAME")
DEFAULT_BUCKET_REGION = "us-east-1"
DEFAULT_BUCKET_PREFIX = "fluxbooth"
# `<bucket>.s3.<region>.amazonaws.com`, `<bucket>.s3-<region>.amazonaws.com`, `<bucket>.s3.<region>.backblazeb2.com`
_VIRTUAL_HOSTED_S3 = re.compile(r"^(?P<bucket>[a-z0-9][a-z0-9.-]*?)\.(?P<service>s3(?:[.-](?P<rest>.+))?)$")
_DIGITALOCEAN_SPACES = re.compile(r"^(?P<bucket>[a-z0-9][a-z0-9-]*)\.(?P<region>[a-z0-9-]+)\.digitaloceanspaces\.com$")


@dataclass(frozen=True)
class BucketLocation:
    """What a bucket URL says: the service to talk to, and the bucket, region and key prefix it names."""

    service_url: str
    bucket: str | None
    region: str | None
    prefix: str
    in_host: bool  # the bucket was read from the host name (virtual-hosted style), not from the path


def locate_bucket(endpoint_url: str) -> BucketLocation:
    """Read a bucket URL as RunPod's docs write BUCKET_ENDPOINT_URL: the bucket in the host
    (`https://<bucket>.s3.<region>.amazonaws.com`, `https://<bucket>.<region>.digitaloceanspaces.com`) or as the
    first path segment (`https://<host>/<bucket>[/prefix]`, for R2, MinIO and other S3-compatible stores)."""
    parts = urlsplit(endpoint_url.strip())
    if parts.scheme not in {"http", "https"} or not parts.hostname:
        raise ValueError(f"BUCKET_ENDPOINT_URL {endpoint_url!r} is not an http(s) URL")
    host = parts.hostname.lower()
    port = f":{parts.port}" if parts.port else ""
    segments = [segment for segment in parts.path.split("/") if segment]
    if spaces := _DIGITALOCEAN_SPACES.match(host):
        return BucketLocation(
            f"{parts.scheme}://{spaces['region']}.digitaloceanspaces.com{port}",
            spaces["bucket"],
            spaces["region"],
            "/".join(segments),
            in_host=True,
        )
    if hosted := _VIRTUAL_HOSTED_S3.match(host):
        return BucketLocation(
            f"{parts.scheme}://{hosted['service']}{port}",
            hosted["bucket"],
            _region_in(hosted["rest"] or ""),
            "/".join(segments),
            in_host=True,
        )
    region = _region_in(host.removeprefix("s3.").removeprefix("s3-")) if host.startswith("s3") else None
    service_url = f"{parts.scheme}://{host}{port}"
    if not segments:
        return BucketLocation(service_url, None, region, "", in_host=False)
    return BucketLocation(service_url, segments[0], region, "/".join(segments[1:]), in_host=False)


def _region_in(rest: str) -> str | None:
    """`us-west-2.amazonaws.com` -> `us-west-2`; `amazonaws.com` (the global endpoint) -> None."""
    first = rest.split(".", 1)[0]
    return first if "." in rest and first not in {"amazonaws", "dualstack"} else None


def bucket_from_environ(env: Mapping[str, str]) -> BucketSettings | None:
    """RunPod's three BUCKET_* variables (plus an optional BUCKET_NAME); None when none of them is set.
    Set but naming no bucket is a mistake to report, never a silent fall back to the worker's disk."""
    if not any(env.get(name, "").strip() for name in BUCKET_VARIABLES):
        return None
    named = env.get("BUCKET_NAME", "").strip()
    endpoint = env.get("BUCKET_ENDPOINT_URL", "").strip()
    location = locate_bucket(endpoint) if endpoint else BucketLocation("", None, None, "", in_host=False)
    if named and location.bucket and named != location.bucket:
        if location.in_host:
            raise ValueError(
                f"BUCKET_NAME={named!r} but BUCKET_ENDPOINT_URL names the bucket {location.bucket!r}; "
                "remove BUCKET_NAME or make them agree"
            )
        # With BUCKET_NAME set, a path-style URL's segments are folders inside that bucket.
        location = dataclasses.replace(location, prefix="/".join(p for p in (location.bucket, location.prefix) if p))
    bucket = named or location.bucket
    if not bucket:
        raise ValueError(
            "BUCKET_ENDPOINT_URL names no bucket: write it as https://<bucket>.s3.<region>.amazonaws.com or "
            "https://<host>/<bucket> (R2, MinIO, other S3-compatible stores), or set BUCKET_NAME"
        )
    prefix = "/".join(
        part
        for part in (location.prefix.strip("/"), env.get("BUCKET_PREFIX", DEFAULT_BUCKET_PREFIX).strip("/"))
        if part
    )
    return BucketSettings(
        endpoint_url=location.service_url or None,
        access_key_id=env.get("BUCKET_ACCESS_KEY_ID", ""),
        secret_access_key=env.get("BUCKET_SECRET_ACCESS_KEY", ""),
        bucket=bucket,
        region=env.get("BUCKET_REGION") or location.region or DEFAULT_BUCKET_REGION,
        prefix=prefix,
        presign_seconds=_int(env, "BUCKET_PRESIGN_SECONDS", 7 * 24 * 3600),
    )


@dataclass(frozen=True)
class DatasetLimits:
    max_base64_chars: int = 96 * 1024 * 1024
    max_download_bytes: int = 2 * 1024**3
    max_members: int = 5000
    max_expanded_bytes: int = 4 * 1024**3
    max_member_bytes: int = 256 * 1024**2
    max_compression_ratio: int = 200
    # The whole archive's declared expansion over its own size (above a small floor): images barely
    # compress, so a zip that expands far more than this holds something other than photos.
    max_archive_expansion_ratio: int = 100
    max_image_pixels: int = 50_000_000
    # Pixels decoded over the whole dataset, each distinct file once: about 330 twelve-megapixel photos,
    # or 70 s of decoding at the slowest rate measured (PNG, 60 Mpx per CPU second; bench/dataset_budgets.py).
    max_dataset_pixels: int = 4_000_000_000
    # Images longer than this (either way) are cropped to their middle: the trainer only uses the middle.
    max_image_aspect_ratio: float = 4.0
    # Disk the normalised images may take (the uncompressed upper bound, checked before decoding).
    max_prepared_bytes: int = 16 * 1024**3
    min_image_side: int = 64
    min_images: int = 3
    max_images: int = 1000
    download_timeout_seconds: int = 60
    allow_private_urls: bool = False


DEFAULT_VOLUME_DIR = "/runpod-volume"
VOLUME_DIR_VARIABLE = "FLUXBOOTH_VOLUME_DIR"
VOLUME_PERSISTENT_VARIABLE = "FLUXBOOTH_VOLUME_PERSISTENT"


def mount_points(mountinfo: str) -> set[str]:
    """The mount points listed in /proc/self/mountinfo (field 5, with the kernel's octal escapes undone)."""
    points = set()
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            points.add(re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), fields[4]))
    return points


def is_mount_point(path: Path) -> bool:
    """True when a file system is mounted exactly at `path`: a network volume, not a folder that happens to exist
    on the container disk (RunPod creates /runpod-volume/huggingface-cache for its cached models, and a download
    to HF_HOME creates it too). Bind mounts count, which os.path.ismount misses on the same device."""
    try:
        return str(path.resolve()) in mount_points(Path("/proc/self/mountinfo").read_text())
    except OSError:
        return os.path.ismount(path)


def persistent_volume(env: Mapping[str, str], is_mounted: Callable[[Path], bool] = is_mount_point) -> Path | None:
    """The folder whose files outlive this worker, or None. FLUXBOOTH_VOLUME_DIR (default /runpod-volume) counts
    when a file system is mounted there, or when FLUXBOOTH_VOLUME_PERSISTENT says so explicitly (1: it is
    persistent although not a mount point of its own; 0: it is not, although mounted)."""
    folder = Path(env.get(VOLUME_DIR_VARIABLE) or DEFAULT_VOLUME_DIR)
    explicit = (env.get(VOLUME_PERSISTENT_VARIABLE) or "").strip()
    persistent = _flag(explicit) if explicit else is_mounted(folder)
    return folder if persistent and folder.is_dir() else None


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
    # Running inside a RunPod pod or serverless worker, whose disk goes with it.
    on_runpod: bool = False
    # The operator's explicit choice to keep weights on the worker's disk on RunPod (no bucket).
    allow_local_output: bool = False
    # What one hour of this worker costs (FLUXBOOTH_PRICE_PER_HOUR, any currency): a dry run's quote.
    price_per_hour: float | None = None
    # FLUXBOOTH_DOWNLOAD_BYTES_PER_SECOND, FLUXBOOTH_UPLOAD_BYTES_PER_SECOND: the plan's download and upload phases.
    transfer_rates: TransferRates = field(default_factory=TransferRates)
    # FLUXBOOTH_CAPTION_MODEL: the captioner of `captioning: "missing"` (fluxbooth.contract.captioning.caption_model).
    caption_model: str = DEFAULT_CAPTION_MODEL
    environ: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def secret_values(self) -> list[str]:
        """Every secret value present in the environment, for redaction."""
        return [self.environ[name] for name in SECRET_ENV_NAMES if self.environ.get(name)]

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerSettings:
        env = dict(os.environ if environ is None else environ)
        cache_home = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        bucket = bucket_from_environ(env)
        limits = DatasetLimits(
            max_images=_int(env, "FLUXBOOTH_MAX_IMAGES", DatasetLimits.max_images),
            max_base64_chars=_int(env, "FLUXBOOTH_MAX_BASE64_CHARS", DatasetLimits.max_base64_chars),
            max_download_bytes=_int(env, "FLUXBOOTH_MAX_DOWNLOAD_BYTES", DatasetLimits.max_download_bytes),
            max_expanded_bytes=_int(env, "FLUXBOOTH_MAX_EXPANDED_BYTES", DatasetLimits.max_expanded_bytes),
            max_archive_expansion_ratio=_int(
                env, "FLUXBOOTH_MAX_ARCHIVE_EXPANSION_RATIO", DatasetLimits.max_archive_expansion_ratio
            ),
            max_image_pixels=_int(env, "FLUXBOOTH_MAX_IMAGE_PIXELS", DatasetLimits.max_image_pixels),
            max_dataset_pixels=_int(env, "FLUXBOOTH_MAX_DATASET_PIXELS", DatasetLimits.max_dataset_pixels),
            max_image_aspect_ratio=_ratio(
                env, "FLUXBOOTH_MAX_IMAGE_ASPECT_RATIO", DatasetLimits.max_image_aspect_ratio
            ),
            max_prepared_bytes=_int(env, "FLUXBOOTH_MAX_PREPARED_BYTES", DatasetLimits.max_prepared_bytes),
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
            job_deadline_seconds=_deadline_seconds(env, "FLUXBOOTH_JOB_DEADLINE_SECONDS", DEFAULT_JOB_DEADLINE_SECONDS),
            volume_dir=persistent_volume(env),
            trainer_module=env.get("FLUXBOOTH_TRAINER_MODULE") or "fluxbooth.train",
            checkpoints_keep=_count(env, "FLUXBOOTH_CHECKPOINTS_KEEP", 2),
            dataset_limits=limits,
            on_runpod=any(env.get(name) for name in RUNPOD_PRESENCE_VARIABLES),
            allow_local_output=_flag(env.get(ALLOW_LOCAL_OUTPUT_VARIABLE)),
            price_per_hour=_price(env, PRICE_VARIABLE),
            transfer_rates=TransferRates.from_environ(env),
            caption_model=env.get(CAPTION_MODEL_VARIABLE, "").strip() or DEFAULT_CAPTION_MODEL,
            environ=env,
        )
