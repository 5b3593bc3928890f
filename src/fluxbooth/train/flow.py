"""FLUX's rectified-flow training objective, as diffusers' `train_dreambooth_flux.py` computes it.

x0: normalised VAE latents; noise ~ N(0, I); sigma sampled per sample from the scheduler's training
sigmas by `compute_density_for_timestep_sampling`; the model sees (1 - sigma) x0 + sigma noise, packed
into 2x2 patches, with timestep = sigma (the transformer multiplies by 1000 itself), and predicts the
velocity noise - x0. The loss is the (optionally weighted) mean squared error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import FluxPipeline
from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3


@dataclass(frozen=True)
class SigmaSampler:
    """Draws training sigmas from a FlowMatchEulerDiscreteScheduler's table."""

    sigmas: torch.Tensor  # [num_train_timesteps] descending, as the scheduler stores them (without the final 0)
    weighting_scheme: str
    logit_mean: float
    logit_std: float
    mode_scale: float

    @classmethod
    def from_scheduler(
        cls, scheduler: object, weighting_scheme: str, logit_mean: float, logit_std: float, mode_scale: float
    ) -> SigmaSampler:
        # The scheduler's training table: timesteps = sigmas * num_train_timesteps, so timestep / 1000 == sigma.
        num_train_timesteps = int(scheduler.config.num_train_timesteps)
        sigmas = scheduler.sigmas[:num_train_timesteps].detach().float().cpu().clone()
        return cls(sigmas, weighting_scheme, logit_mean, logit_std, mode_scale)

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        u = compute_density_for_timestep_sampling(
            weighting_scheme=self.weighting_scheme,
            batch_size=batch_size,
            logit_mean=self.logit_mean,
            logit_std=self.logit_std,
            mode_scale=self.mode_scale,
            generator=generator,
        )
        indices = (u * len(self.sigmas)).long().clamp(0, len(self.sigmas) - 1)
        return self.sigmas[indices]

    def loss_weighting(self, sigmas: torch.Tensor) -> torch.Tensor:
        return compute_loss_weighting_for_sd3(weighting_scheme=self.weighting_scheme, sigmas=sigmas)


@dataclass
class FlowInputs:
    """One micro-batch, ready for the transformer and the loss."""

    hidden_states: torch.Tensor  # packed noisy latents [B, h/2 * w/2, 4C]
    timestep: torch.Tensor  # [B]
    guidance: torch.Tensor | None  # [B]
    img_ids: torch.Tensor  # [h/2 * w/2, 3]
    target: torch.Tensor  # noise - x0, unpacked [B, C, h, w], float32
    weighting: torch.Tensor  # [B, 1, 1, 1]
    latent_shape: tuple[int, int, int, int]


def build_flow_inputs(
    latents: torch.Tensor,
    *,
    sampler: SigmaSampler,
    generator: torch.Generator,
    guidance_scale: float | None,
    device: torch.device,
    dtype: torch.dtype,
    sigmas: torch.Tensor | None = None,
) -> FlowInputs:
    """`latents`: normalised x0 [B, C, h, w] float32 on the CPU. Randomness comes only from `generator`;
    `sigmas` [B] fixes the noise levels instead of sampling them (for a repeatable evaluation)."""
    batch_size, channels, height, width = latents.shape
    noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    if sigmas is None:
        sigmas = sampler.sample(batch_size, generator)
    sigmas_b = sigmas.view(batch_size, 1, 1, 1)
    noisy = (1.0 - sigmas_b) * latents + sigmas_b * noise
    packed = FluxPipeline._pack_latents(noisy, batch_size, channels, height, width)
    img_ids = FluxPipeline._prepare_latent_image_ids(batch_size, height // 2, width // 2, device, dtype)
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
    )


def unpack_prediction(prediction: torch.Tensor, latent_shape: tuple[int, int, int, int]) -> torch.Tensor:
    """Packed [B, tokens, 4C] → [B, C, h, w] (the inverse of FluxPipeline._pack_latents)."""
    batch_size, channels, height, width = latent_shape
    prediction = prediction.view(batch_size, height // 2, width // 2, channels, 2, 2)
    prediction = prediction.permute(0, 3, 1, 4, 2, 5)
    return prediction.reshape(batch_size, channels, height, width)


def per_sample_loss(prediction: torch.Tensor, inputs: FlowInputs) -> torch.Tensor:
    """Weighted MSE per sample [B], in float32."""
    squared = inputs.weighting * (prediction.float() - inputs.target.float()) ** 2
    return squared.reshape(squared.shape[0], -1).mean(dim=1)
