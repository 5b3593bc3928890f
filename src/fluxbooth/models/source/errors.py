"""The refusals of a base model that cannot be had: found nowhere, too large for the disk, refused by the hub, a
cache that cannot be written; each says what to do instead. No torch here.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from pathlib import Path

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.messages import format_bytes
from fluxbooth.models.refusals import base_model_refusal, endpoint_refusal
from fluxbooth.models.source.places import DEFAULT_RUNPOD_MODEL_CACHE, Look, ModelPlaces, PendingDownload

# What a full or unwritable cache volume raises while the client writes.
CACHE_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS})


def describe_model(repo_id: str, revision: str | None) -> str:
    return f"{repo_id} (revision {revision})" if revision else repo_id


def how_to_provide(repo_id: str) -> str:
    return (
        f"Provide it one of these ways: bake it into the image (`hf download {repo_id} --cache-dir /models`, "
        "FLUXBOOTH_BAKED_MODELS_DIR); select it as the endpoint's RunPod cached model (it appears under "
        f"{DEFAULT_RUNPOD_MODEL_CACHE}); put it on a network volume in the Hugging Face cache layout and "
        "point HF_HOME at it (HF_HOME=/runpod-volume/huggingface-cache); or let the worker download it once "
        "(unset HF_HUB_OFFLINE, and set HF_TOKEN for gated models)"
    )


def not_found_error(repo_id: str, revision: str | None, looks: Sequence[Look], field: str) -> FluxboothError:
    looked = "; ".join(look.describe() for look in looks)
    return base_model_refusal(
        field,
        f"{field}: {describe_model(repo_id, revision)} is not on this worker and downloads are off "
        f"(HF_HUB_OFFLINE=1). Looked in: {looked}. {how_to_provide(repo_id)}",
        looked_in=[str(look.path) for look in looks],
    )


def download_does_not_fit(pending: PendingDownload, free_bytes: int) -> FluxboothError | None:
    if pending.bytes_total <= free_bytes:
        return None
    return FluxboothError(
        ErrorCode.DOES_NOT_FIT,
        f"disk: downloading {pending.repo_id} needs {format_bytes(pending.bytes_total)} "
        f"({len(pending.files)} files) but only {format_bytes(free_bytes)} are free under {pending.cache_dir}; "
        "free space there, point HF_HOME at a bigger volume, or provide the model another way "
        "(baked into the image, RunPod cached model)",
        refresh_worker=False,
        details={"needed_bytes": pending.bytes_total, "free_bytes": free_bytes},
    )


def download_and_training_do_not_fit(
    pending: PendingDownload, training_bytes: int, free_bytes: int
) -> FluxboothError | None:
    """When the cache and the job's directory share a disk, the model and the training run must both fit."""
    needed = pending.bytes_total + training_bytes
    if needed <= free_bytes:
        return None
    return FluxboothError(
        ErrorCode.DOES_NOT_FIT,
        f"disk: downloading {pending.repo_id} ({format_bytes(pending.bytes_total)}) and then training (about "
        f"{format_bytes(training_bytes)}: caches, checkpoints and the exported weights) need "
        f"{format_bytes(needed)} on the disk holding {pending.cache_dir}, but only {format_bytes(free_bytes)} "
        "are free; free space there, point HF_HOME at another volume, or provide the model another way "
        "(baked into the image, RunPod cached model)",
        refresh_worker=False,
        details={"needed_bytes": needed, "free_bytes": free_bytes},
    )


def hub_error(error: Exception, repo_id: str, revision: str | None, places: ModelPlaces, field: str) -> FluxboothError:
    """The hub's refusal in the worker's error contract, saying what to change."""
    # huggingface_hub on use only: see fluxbooth.models.source.
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    # The client wraps what the hub said (a dry run raises DryRunError from it): look down the chain.
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, RepositoryNotFoundError | RevisionNotFoundError):
        cause = cause.__cause__
    error = cause if isinstance(cause, Exception) else error
    page = f"{places.hub_url}/{repo_id}"
    if isinstance(error, GatedRepoError):
        if places.token is None:
            message = (
                f"{field}: {repo_id} is a gated model and the worker has no Hugging Face token: accept its "
                f"license at {page} with your account, then set HF_TOKEN (a read token of that account) on "
                "the endpoint"
            )
        else:
            message = (
                f"{field}: the account of HF_TOKEN has no access to the gated model {repo_id}: accept its "
                f"license at {page} with that account, or set HF_TOKEN to a token of an account that has"
            )
        return endpoint_refusal(message)
    if isinstance(error, RevisionNotFoundError):
        return FluxboothError(
            ErrorCode.INVALID_INPUT,
            f"input.base_model_revision: {repo_id} has no revision {revision!r} on the Hub ({page}); give a "
            "branch, tag or commit hash that exists",
            refresh_worker=False,
        )
    if isinstance(error, RepositoryNotFoundError):
        return base_model_refusal(
            field,
            f"{field}: {repo_id} was not found on the Hub ({page}); check the id, and set HF_TOKEN if the "
            "repository is private",
        )
    return endpoint_refusal(
        f"{field}: {describe_model(repo_id, revision)} is not on this worker and the Hub at {places.hub_url} "
        f"could not be asked ({type(error).__name__}: {str(error)[:300]}). {how_to_provide(repo_id)}"
    )


def cache_error(error: Exception, cache_dir: Path, repo_id: str) -> FluxboothError | None:
    """A full or unwritable cache volume, told apart from the hub's answers (which are OSErrors too)."""
    if not isinstance(error, OSError) or error.errno not in CACHE_DISK_ERRNOS:
        return None
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return FluxboothError(
            ErrorCode.DOES_NOT_FIT,
            f"disk: the disk under {cache_dir} filled up while downloading {repo_id} ({error.strerror}); free "
            "space there or point HF_HOME at a bigger volume",
            refresh_worker=False,
        )
    return endpoint_refusal(
        f"base_model: the Hugging Face cache {cache_dir} cannot be written ({error.strerror}); point HF_HOME "
        "at a writable volume"
    )
