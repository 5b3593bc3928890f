"""How training sigmas are drawn (train/flow.py's SigmaSampler, train.json's timestep_sampling): diffusers'
densities over FLUX.1-dev's scheduler table, kohya's sigmoid draws, a fixed shift and FLUX's resolution-dependent
shift, each checked against the formula it follows."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from fluxbooth.models.published_configs import FLUX1_DEV_SCHEDULER
from fluxbooth.train.failures import TrainerFailure
from fluxbooth.train.flow import SigmaSampler, shifted
from fluxbooth.train.session import validate_config
from tests.support.trainer_jobs import make_plan, make_trainer_config

DRAWS = 4000
FLUX1_1024_TOKENS = 4096  # a 1024x1024 image: 64 x 64 packed latent tokens


def config(**fields: object) -> object:
    return make_trainer_config(Path("/job"), Path("/base"), make_plan(training_type="lora"), **fields)


def sampler(timestep_sampling: str) -> SigmaSampler:
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX1_DEV_SCHEDULER)
    return SigmaSampler.from_scheduler(scheduler, config(timestep_sampling=timestep_sampling))


def draw(timestep_sampling: str, tokens: int = FLUX1_1024_TOKENS, seed: int = 0) -> torch.Tensor:
    return sampler(timestep_sampling).sample(DRAWS, torch.Generator().manual_seed(seed), image_tokens=tokens)


def sigmoid_of_normal(seed: int = 0) -> torch.Tensor:
    """kohya's draw: sigmoid(sigmoid_scale * N(0, 1)), sigmoid_scale 1."""
    return torch.sigmoid(torch.randn(DRAWS, generator=torch.Generator().manual_seed(seed)))


def test_uniform_draws_come_from_the_schedulers_table_evenly() -> None:
    sigmas = draw("uniform")

    assert set(sigmas.tolist()) <= set(sampler("uniform").sigmas.tolist())
    assert abs(float(sigmas.mean()) - 0.5) < 0.02


def test_logit_normal_indexes_the_table_with_a_sigmoid_of_a_normal_as_diffusers_does() -> None:
    table = sampler("logit_normal").sigmas
    u = torch.sigmoid(torch.normal(0.0, 1.0, size=(DRAWS,), generator=torch.Generator().manual_seed(0)))

    assert torch.equal(draw("logit_normal"), table[(u * len(table)).long()])


def test_mode_concentrates_on_the_middle_of_the_schedule() -> None:
    assert float(draw("mode").std()) < float(draw("uniform").std())


def test_sigmoid_is_kohyas_sigmoid_of_a_normal() -> None:
    assert torch.equal(draw("sigmoid"), sigmoid_of_normal())


def test_shift_moves_kohyas_draws_by_the_discrete_flow_shift() -> None:
    assert torch.allclose(draw("shift"), 3.0 * sigmoid_of_normal() / (1 + 2.0 * sigmoid_of_normal()))


@pytest.mark.parametrize(("tokens", "mu"), [(256, 0.5), (4096, 1.15), (1024, 0.5 + 0.65 * 768 / 3840)])
def test_flux_shift_uses_fluxs_mu_for_the_images_token_count(tokens: int, mu: float) -> None:
    assert torch.allclose(draw("flux_shift", tokens), shifted(sigmoid_of_normal(), math.exp(mu)))


def test_flux_shift_trains_larger_images_at_more_noise() -> None:
    assert (
        float(draw("flux_shift", 4096).mean()) > float(draw("flux_shift", 256).mean()) > float(draw("sigmoid").mean())
    )


@pytest.mark.parametrize("timestep_sampling", ["uniform", "sigmoid", "logit_normal", "mode", "shift", "flux_shift"])
def test_every_sampler_is_the_same_for_the_same_seed_and_stays_within_zero_and_one(timestep_sampling: str) -> None:
    first, again, other = draw(timestep_sampling), draw(timestep_sampling), draw(timestep_sampling, seed=1)

    assert torch.equal(first, again) and not torch.equal(first, other)
    assert float(first.min()) > 0 and float(first.max()) <= 1


def test_a_weighting_scheme_that_is_a_density_is_refused_naming_timestep_sampling() -> None:
    with pytest.raises(TrainerFailure) as caught:
        validate_config(config(weighting_scheme="logit_normal"))

    assert caught.value.message == (
        "weighting_scheme 'logit_normal' must be one of ['none', 'sigma_sqrt', 'cosmap'] (it weighs the loss; a "
        "sigma density such as logit_normal or mode is timestep_sampling)"
    )


def test_an_unknown_timestep_sampling_in_train_json_is_refused() -> None:
    with pytest.raises(TrainerFailure) as caught:
        validate_config(config(timestep_sampling="sigma"))

    assert caught.value.message == (
        "timestep_sampling 'sigma' must be one of ['uniform', 'sigmoid', 'logit_normal', 'mode', 'shift', 'flux_shift']"
    )
