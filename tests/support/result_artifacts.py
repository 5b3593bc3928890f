"""The local file a finished job's result names for one of its artifacts (a worker without a bucket hands out
file:// uris)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


def artifact_path(result: dict[str, Any], name: str) -> Path:
    (artifact,) = [artifact for artifact in result["artifacts"] if artifact["name"] == name]
    return Path(unquote(urlsplit(artifact["uri"]).path))
