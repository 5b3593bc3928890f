"""The session stage's card emulation (FLUXBOOTH_CUDA_MEMORY_FRACTION), checked before anything loads."""

from __future__ import annotations

import pytest
import torch

from fluxbooth.contract.environment import CUDA_MEMORY_FRACTION_ENV
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.session import limit_cuda_memory


def test_without_the_variable_nothing_is_limited() -> None:
    assert limit_cuda_memory({}) is None


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_a_fraction_outside_zero_to_one_is_invalid_config_naming_the_variable(value: str) -> None:
    with pytest.raises(TrainerFailure) as raised:
        limit_cuda_memory({CUDA_MEMORY_FRACTION_ENV: value})
    assert (raised.value.code, raised.value.message) == (
        "invalid_config",
        f"{CUDA_MEMORY_FRACTION_ENV}={value!r} must be above 0 and at most 1",
    )


def test_a_fraction_that_is_not_a_number_is_invalid_config_naming_the_variable() -> None:
    with pytest.raises(TrainerFailure) as raised:
        limit_cuda_memory({CUDA_MEMORY_FRACTION_ENV: "half"})
    assert raised.value.message == f"{CUDA_MEMORY_FRACTION_ENV}='half' is not a number between 0 and 1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_a_valid_fraction_is_accepted_and_ignored() -> None:
    assert limit_cuda_memory({CUDA_MEMORY_FRACTION_ENV: "0.5"}) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_cuda_the_fraction_is_applied() -> None:
    assert limit_cuda_memory({CUDA_MEMORY_FRACTION_ENV: "0.5"}) == 0.5
