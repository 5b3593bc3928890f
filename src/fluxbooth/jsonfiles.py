"""JSON read with a size and a nesting bound: a hostile file (a model's config, a request given to `plan`) is a
clear ValueError, never a RecursionError or a memory blow-up."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# Diffusers and transformers configs nest a few levels; requests two. Python's json recurses once per level.
MAX_JSON_DEPTH = 64
# A model's config is kilobytes; a request file carries the dataset as base64 (the worker caps that itself).
MAX_CONFIG_BYTES = 4 * 1024 * 1024
MAX_REQUEST_BYTES = 512 * 1024 * 1024

# One pass, each match starting where the last ended: an escape pair, a quote or a bracket. A regex that matched whole
# strings backtracked over an unterminated one from every quote in it, quadratic in a run of escaped quotes.
_TOKEN = re.compile(r'\\.|["\[\]{}]', re.DOTALL)


class JSONBoundError(ValueError):
    """JSON over a bound: nested too deep, or too large."""


def nesting_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, brackets inside strings not counted."""
    depth = deepest = 0
    in_string = False
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token == '"':
            in_string = not in_string
        elif in_string or token[0] == "\\":
            continue
        elif token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def parse_json(text: str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """json.loads with a nesting bound (JSONBoundError past it); malformed JSON is json's ValueError."""
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JSONBoundError(f"nested {depth:,} levels deep, over the bound of {max_depth}")
    return json.loads(text)


def read_json_file(path: Path, *, max_bytes: int = MAX_CONFIG_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A JSON file within `max_bytes` and `max_depth` (JSONBoundError); a missing file is FileNotFoundError."""
    with path.open("rb") as handle:
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise JSONBoundError(f"larger than the bound of {max_bytes:,} bytes")
    return parse_json(data.decode("utf-8"), max_depth=max_depth)
