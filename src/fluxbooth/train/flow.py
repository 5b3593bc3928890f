"""FLUX's rectified-flow training objective, as diffusers' DreamBooth LoRA scripts compute it for each family.

x0: normalised VAE latents (the family's normalisation: train.family_ops); noise ~ N(0, I); sigma sampled
per sample as train.json's timestep_sampling says (diffusers' densities over the scheduler's training sigmas,
or kohya's continuous sigmoid draws, optionally shifted); the model sees
(1 - sigma) x0 + sigma noise, packed into tokens as the family lays them out (FLUX.1: 2x2 patches; FLUX.2:
one token per patched latent pixel), with timestep = sigma (the transformer multiplies by 1000 itself), and
predicts the velocity noise - x0. FLUX.1 Kontext also sees the clean control latents' tokens after the
target's and its prediction is cut back to the target's tokens. The loss is the (optionally weighted) mean
squared error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.train.family_ops import FamilyOps

# FLUX's resolution-dependent shift (its scheduler's config; these are FLUX.1's, which kohya hard-codes):
# mu grows linearly from base_shift at base_image_seq_len image tokens to max_shift at max_image_seq_len.
FLUX_SHIFT_DEFAULTS = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}
DIFFUSERS_DENSITIES = {"uniform": "none", "logit_normal": "logit_normal", "mode": "mode"}


def shifted(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """sigma' = shift·sigma / (1 + (shift - 1)·sigma): more of the draws at high noise for shift > 1 (kohya's
    "shift"; with shift = e^mu, FLUX's time_shift(mu, 1, sigma))."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


@dataclass(frozen=True)
class SigmaSampler:
    """Draws training sigmas (train.json's timestep_sampling) and weighs the loss by them (weighting_scheme)."""

    sigmas: torch.Tensor  # [num_train_timesteps] descending, as the scheduler stores them (without the final 0)
    timestep_sampling: str
    weighting_scheme: str
    logit_mean: float
    logit_std: float
    mode_scale: float
    sigmoid_scale: float
    discrete_flow_shift: float
    shift_config: dict[str, float]  # FLUX_SHIFT_DEFAULTS' keys, from the scheduler's config

    @classmethod
    def from_scheduler(cls, scheduler: Any, config: TrainerConfig) -> SigmaSampler:
        # The scheduler's training table: timesteps = sigmas * num_train_timesteps, so timestep / 1000 == sigma.
        num_train_timesteps = int(scheduler.config.num_train_timesteps)
        sigmas = scheduler.sigmas[:num_train_timesteps].detach().float().cpu().clone()
        shift_config = {name: float(scheduler.config.get(name) or value) for name, value in FLUX_SHIFT_DEFAULTS.items()}
        return cls(
            sigmas,
            config.optimisation.timestep_sampling,
            config.optimisation.weighting_scheme,
            config.optimisation.logit_mean,
            config.optimisation.logit_std,
            config.optimisation.mode_scale,
            config.optimisation.sigmoid_scale,
            config.optimisation.discrete_flow_shift,
            shift_config,
        )

    def flux_mu(self, image_tokens: int) -> float:
        """FLUX's shift exponent for an image of `image_tokens` tokens (diffusers' calculate_shift)."""
        config = self.shift_config
        slope = (config["max_shift"] - config["base_shift"]) / (
            config["max_image_seq_len"] - config["base_image_seq_len"]
        )
        return config["base_shift"] + slope * (image_tokens - config["base_image_seq_len"])

    def sample(self, batch_size: int, generator: torch.Generator, image_tokens: int) -> torch.Tensor:
        """`batch_size` sigmas for images of `image_tokens` tokens, all randomness from `generator`."""
        if self.timestep_sampling in DIFFUSERS_DENSITIES:
            u = compute_density_for_timestep_sampling(
                weighting_scheme=DIFFUSERS_DENSITIES[self.timestep_sampling],
                batch_size=batch_size,
                logit_mean=self.logit_mean,
                logit_std=self.logit_std,
                mode_scale=self.mode_scale,
                generator=generator,
            )
            indices = (u * len(self.sigmas)).long().clamp(0, len(self.sigmas) - 1)
            return self.sigmas[indices]
        sigmas = torch.sigmoid(self.sigmoid_scale * torch.randn(batch_size, generator=generator))
        if self.timestep_sampling == "shift":
            return shifted(sigmas, self.discrete_flow_shift)
        if self.timestep_sampling == "flux_shift":
            return shifted(sigmas, math.exp(self.flux_mu(image_tokens)))
        return sigmas

    def loss_weighting(self, sigmas: torch.Tensor) -> torch.Tensor:
        return compute_loss_weighting_for_sd3(weighting_scheme=self.weighting_scheme, sigmas=sigmas)


@dataclass
class FlowInputs:
    """One micro-batch, ready for the transformer and the loss."""

    hidden_states: torch.Tensor  # packed noisy latents [B, tokens, C'] (then the control's tokens, Kontext)
    timestep: torch.Tensor  # [B]
    guidance: torch.Tensor | None  # [B]
    img_ids: torch.Tensor  # the tokens' position ids, as the family's transformer takes them
    target: torch.Tensor  # noise - x0, unpacked [B, C, h, w], float32
    weighting: torch.Tensor  # [B, 1, 1, 1]
    latent_shape: tuple[int, int, int, int]
    target_tokens: int = 0  # how many of the tokens are the target's (the rest are the control's)


def build_flow_inputs(
    latents: torch.Tensor,
    *,
    sampler: SigmaSampler,
    generator: torch.Generator,
    guidance_scale: float | None,
    device: torch.device,
    dtype: torch.dtype,
    layout: FamilyOps,
    sigmas: torch.Tensor | None = None,
    control: torch.Tensor | None = None,
) -> FlowInputs:
    """`latents`: normalised x0 [B, C, h, w] float32 on the CPU, laid out into tokens by the family's
    `layout`. Randomness comes only from `generator`; `sigmas` [B] fixes the noise levels instead of sampling
    them (for a repeatable evaluation). `control`: normalised latents of the control images (Kontext pairs)."""
    batch_size, channels, height, width = latents.shape
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if sigmas is None:
        sigmas = sampler.sample(batch_size, generator, image_tokens=layout.pack(latents[:1]).shape[1])
    sigmas_b = sigmas.view(batch_size, 1, 1, 1)
    noisy = (1.0 - sigmas_b) * latents + sigmas_b * noise
    packed = layout.pack(noisy)
    img_ids = layout.image_ids(noisy, device, dtype)
    target_tokens = packed.shape[1]
    if control is not None:
        control_packed, control_ids = layout.control_tokens(control, device, dtype)
        packed, img_ids = torch.cat([packed, control_packed], dim=1), torch.cat([img_ids, control_ids], dim=-2)
    guidance = None
    if guidance_scale is not None:
        guidance = torch.full((batch_size,), float(guidance_scale), device=device, dtype=torch.float32)
    return FlowInputs(
        hidden_states=packed.to(device=device, dtype=dtype),
        timestep=sigmas.to(device=device, dtype=dtype),
        guidance=guidance,
        img_ids=img_ids,
        target=(noise - latents).to(device),
        weighting=sampler.loss_weighting(sigmas_b).float().to(device),
        latent_shape=(batch_size, channels, height, width),
        target_tokens=target_tokens,
    )


def unpack_prediction(prediction: torch.Tensor, inputs: FlowInputs, layout: FamilyOps) -> torch.Tensor:
    """The prediction for the target's tokens, back in the latents' shape [B, C, h, w]."""
    return layout.unpack(prediction[:, : inputs.target_tokens], inputs.latent_shape)


def per_sample_loss(prediction: torch.Tensor, inputs: FlowInputs) -> torch.Tensor:
    """Weighted MSE per sample [B], in float32."""
    squared = inputs.weighting * (prediction.float() - inputs.target.float()) ** 2
    return squared.reshape(squared.shape[0], -1).mean(dim=1)
