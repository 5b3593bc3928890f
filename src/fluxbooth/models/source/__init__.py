"""Where the base model comes from: a local folder for every `base_model`, found or fetched before any
money is spent.

A hub id (`org/name`, optionally pinned with `base_model_revision`) is looked up, in this order, in
- the standard Hugging Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`);
- RunPod's cached models (`FLUXBOOTH_RUNPOD_MODEL_CACHE`, default `/runpod-volume/huggingface-cache/hub`);
- the models baked into the image (`FLUXBOOTH_BAKED_MODELS_DIR`, default `/models`), either as a Hugging
  Face cache (`hf download ID --cache-dir /models`) or as plain `org/name` folders (`--local-dir`).

Found nowhere with downloads off (`HF_HUB_OFFLINE=1`), the job is refused at once, naming every place
looked at. With downloads on, the hub's metadata is read first (gated access, file sizes, free disk), only
the configs are fetched for the planner, and the weights of the diffusers pipeline (never the repo's
single-file checkpoints) are downloaded later into the standard cache, with progress.

Everything goes through the real `huggingface_hub` client (`snapshot_download`, `scan_cache_dir`), with
the cache, endpoint and token passed explicitly from the job's settings, and imported where it is used (as
tqdm is): the handler's cold start, and a job whose model is cached, never load it.

- `places`: the places looked in (from the job's environment) and what looking yields;
- `cache`: a model already on this worker; `download`: one fetched from the hub, with progress;
- `errors`: the refusals when it can be had neither way; `resolve`: `resolve_base_model`, which ties them together.

No torch here.
"""

from fluxbooth.models.source.cache import (
    locate_hub_model,
    missing_pipeline_files,
)
from fluxbooth.models.source.download import (
    DownloadStopped,
    ProgressSink,
    download_base_model,
    download_pending,
    ensure_room_to_download,
    prepare_download,
)
from fluxbooth.models.source.errors import (
    CACHE_DISK_ERRNOS,
    cache_error,
    describe_model,
    download_and_training_do_not_fit,
    download_does_not_fit,
    how_to_provide,
    hub_error,
    not_found_error,
)
from fluxbooth.models.source.places import (
    DEFAULT_BAKED_MODELS_DIR,
    DEFAULT_HUB_ENDPOINT,
    DEFAULT_RUNPOD_MODEL_CACHE,
    PIPELINE_FILE_PATTERNS,
    SIZING_FILE_PATTERNS,
    Look,
    ModelPlaces,
    PendingDownload,
    ResolvedModel,
    hub_cache_dir,
)
from fluxbooth.models.source.resolve import (
    TINY_BUILD_TIMEOUT_SECONDS,
    ensure_tiny_model,
    local_model_folder,
    pending_download_bytes,
    resolve_base_model,
    resolve_hub_model,
)

__all__ = [
    "CACHE_DISK_ERRNOS",
    "DEFAULT_BAKED_MODELS_DIR",
    "DEFAULT_HUB_ENDPOINT",
    "DEFAULT_RUNPOD_MODEL_CACHE",
    "DownloadStopped",
    "Look",
    "ModelPlaces",
    "PIPELINE_FILE_PATTERNS",
    "PendingDownload",
    "ProgressSink",
    "ResolvedModel",
    "SIZING_FILE_PATTERNS",
    "TINY_BUILD_TIMEOUT_SECONDS",
    "cache_error",
    "describe_model",
    "download_and_training_do_not_fit",
    "download_base_model",
    "download_does_not_fit",
    "download_pending",
    "ensure_room_to_download",
    "ensure_tiny_model",
    "how_to_provide",
    "hub_cache_dir",
    "hub_error",
    "local_model_folder",
    "locate_hub_model",
    "missing_pipeline_files",
    "not_found_error",
    "pending_download_bytes",
    "prepare_download",
    "resolve_base_model",
    "resolve_hub_model",
]
