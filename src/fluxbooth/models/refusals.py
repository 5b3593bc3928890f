"""Who can fix a base model the worker cannot have, as an error code: the caller, for a model the request
names, or the endpoint's owner, for the endpoint's default, its token, its cache volume or its reach to the
Hub. Neither is `internal`, which the docs reserve for a bug."""

from __future__ import annotations

from typing import Any

from fluxbooth.errors import ErrorCode, FluxboothError

DEFAULT_MODEL_FIELD = "base_model (the endpoint's default, FLUXBOOTH_BASE_MODEL)"
ENDPOINT_FIXES = "the endpoint's owner must fix this"


def base_model_refusal(field: str, message: str, **details: Any) -> FluxboothError:
    """A base model that cannot be had, coded by who can fix it: the caller for a model the request names
    (`invalid_input`), the endpoint's owner for the endpoint's default (`worker_unfit`; a fresh worker
    shares the setting, so the worker stays)."""
    if field == DEFAULT_MODEL_FIELD:
        return FluxboothError(
            ErrorCode.WORKER_UNFIT, f"{message} ({ENDPOINT_FIXES})", refresh_worker=False, details=details
        )
    return FluxboothError(ErrorCode.INVALID_INPUT, message, refresh_worker=False, details=details)


def endpoint_refusal(message: str) -> FluxboothError:
    """Something only the endpoint's owner can change (a token, the cache volume, the hub's reach)."""
    return FluxboothError(ErrorCode.WORKER_UNFIT, f"{message} ({ENDPOINT_FIXES})", refresh_worker=False)
