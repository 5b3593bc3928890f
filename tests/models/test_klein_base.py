"""A FLUX.2 [klein] job on a step-distilled checkpoint is warned to train on the base checkpoint instead."""

from __future__ import annotations

import pytest

from fluxbooth.models.families import distilled_base_warning


@pytest.mark.parametrize(
    ("base_model", "base"),
    [
        ("black-forest-labs/FLUX.2-klein-4B", "black-forest-labs/FLUX.2-klein-base-4B"),
        ("black-forest-labs/FLUX.2-klein-9B", "black-forest-labs/FLUX.2-klein-base-9B"),
    ],
)
def test_a_distilled_klein_checkpoint_is_warned_with_the_base_to_train_on(base_model: str, base: str) -> None:
    warning = distilled_base_warning("flux2-klein", {"is_distilled": True}, base_model)

    assert warning == (
        f"base_model: {base_model} is a step-distilled FLUX.2 [klein] checkpoint (model_index.json is_distilled); "
        f"LoRAs trained on a distilled checkpoint tend to collapse or lose its few-step sampling: train on {base} "
        "instead, and use the LoRA with either"
    )


def test_a_klein_base_checkpoint_is_not_warned() -> None:
    assert (
        distilled_base_warning("flux2-klein", {"is_distilled": False}, "black-forest-labs/FLUX.2-klein-base-4B") is None
    )


def test_another_familys_model_index_is_not_read_as_klein() -> None:
    assert distilled_base_warning("flux1", {"is_distilled": True}, "black-forest-labs/FLUX.1-dev") is None
