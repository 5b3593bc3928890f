"""Requests as the request tests write them: the fewest fields a training request needs, and the message of a
request `parse_request` refuses as invalid input."""

from __future__ import annotations

from typing import Any

import pytest

from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request.model import TrainingRequest, parse_request


def minimal(dataset: str, **fields: Any) -> dict[str, Any]:
    return {"model_name": "sks-dog", "dataset": dataset, "instance_prompt": "a photo of sks dog", **fields}


def refusal(raw: object) -> str:
    with pytest.raises(FluxboothError) as caught:
        parse_request(raw)
    assert caught.value.code is ErrorCode.INVALID_INPUT
    return caught.value.message


def url_request(**fields: Any) -> TrainingRequest:
    """The fewest fields of a request whose dataset is a URL, with `fields` on top, parsed."""
    return parse_request(
        {
            "model_name": "m",
            "dataset_url": "https://example.com/d.zip",
            "instance_prompt": "a photo of sks dog",
            **fields,
        }
    )


def url_request_refusal(**fields: Any) -> str:
    """The message of `url_request(**fields)`, refused as invalid input."""
    with pytest.raises(FluxboothError) as caught:
        url_request(**fields)
    assert caught.value.code is ErrorCode.INVALID_INPUT
    return caught.value.message
