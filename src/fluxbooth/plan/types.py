"""The planner's data: the job as the planner reads it, strategies, estimates, candidates and the `Plan`.

`Plan` is shared with launch_files.py and the result contract. No torch here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from fluxbooth.contract.buckets import Resolution
from fluxbooth.contract.captioning import captioner_bytes
from fluxbooth.contract.names import GUIDANCE_DISTILLED_SAMPLING
from fluxbooth.contract.precision import QUANTISED_PRECISIONS
from fluxbooth.request.limits import DEFAULT_TRAINING_TYPE
from fluxbooth.request.spec import JobSpec
from fluxbooth.settings import DatasetLimits, TransferRates

Offload = Literal["none", "cpu", "nvme"]

ALTERNATIVE_LORA_RANK = 16
# Phases of a job, in the order they run (docs/memory.md, "Phases").
PHASES: tuple[str, ...] = (
    "captioning",
    "loading",
    "caching",
    "class_images",
    "training",
    "validation",
    "export",
    "scoring",
    "report",
)
# Every phase that takes time, in order: the base model's download before the trainer's phases, the artifacts'
# upload after them (network only: no GPU or host memory of their own beyond the worker's).
TIMED_PHASES: tuple[str, ...] = ("download", *PHASES, "upload")


@dataclass(frozen=True)
class PhaseEstimate:
    """Predicted peak memory and duration of one phase of the job."""

    gpu_bytes: int
    host_bytes: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    accelerator: Literal["cuda", "cpu"]
    num_processes: int
    training_type: Literal["full", "lora"]
    use_deepspeed: bool
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    mixed_precision: Literal["bf16", "fp16", "no"]
    gradient_checkpointing: bool
    optimizer: str
    predicted_gpu_bytes: int
    predicted_host_bytes: int
    predicted_disk_bytes: int
    nvme_path: str | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)
    predicted_seconds_per_step: float | None = None
    # Text encoders and VAE run on the CPU while caching when they would not fit the GPU.
    cache_encoders_on_cpu: bool = False
    # How the frozen LoRA base is stored ("bf16": unquantised in the compute dtype; always so for full).
    base_precision: str = "bf16"
    # Peak memory and time of every phase, in TIMED_PHASES order; empty for hand-built plans.
    phases: tuple[tuple[str, PhaseEstimate], ...] = ()
    predicted_total_seconds: float | None = None
    # A full fine-tune on bf16 weights with Adafactor fused into the backward pass, without DeepSpeed
    # (Strategy.fused_backward_pass; the trainer's train/fused_adafactor.py).
    fused_backward_pass: bool = False
    # The frozen LoRA base (or the fused full fine-tune's trained blocks) streams block by block from pinned
    # host RAM (Strategy.block_swap).
    block_swap: bool = False
    # Optimizer steps between checkpoints: the request's, or the planner's for a run that uses more than half of
    # its deadline (plan.checks.auto_checkpointing); None: no periodic checkpoints.
    checkpointing_steps: int | None = None
    # Seconds a run stopped by its deadline needs after its last step to checkpoint, export and upload: the
    # trainer stops that long before the deadline (TrainerConfig.stop_at_unix_seconds).
    predicted_stop_reserve_seconds: float | None = None
    # Activation checkpointing (Strategy.checkpoint_every): every k-th block of each stack recomputed in the
    # backward, 1 every block; read only where gradient_checkpointing is on (off: none).
    checkpoint_every: int = 1
    # Several GPUs on a /dev/shm too small for NCCL's shared-memory transport (plan/container_limits.py): the
    # trainer runs with NCCL_SHM_DISABLE=1 (job/launch_files.py child_environment).
    nccl_shm_disable: bool = False
    # Parameters the run trains (the adapter's for LoRA); None for hand-built plans. ZeRO-1/2's buckets are sized
    # from it (contract.deepspeed_numbers.zero2_bucket_elements).
    trainable_params: int | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["warnings"] = list(self.warnings)
        data["phases"] = {name: asdict(phase) for name, phase in self.phases}
        return data


@dataclass(frozen=True)
class JobShape:
    """What the planner reads of a job: built from the job spec (`from_spec`), or by hand for a benchmark or a
    machine check (the defaults are a default request's)."""

    training_type: str = DEFAULT_TRAINING_TYPE
    lora_rank: int = 16
    # The layers LoRA adapts (the spec's, concrete); empty in a hand-built shape: the model family's.
    lora_targets: tuple[str, ...] = ()
    base_precision: str = "auto"
    zero_stage: int | str = "auto"
    offload: str = "auto"
    use_deepspeed: bool = True
    mixed_precision: str = "bf16"
    # The request's: True every block checkpointed, False none, None the planner's choice (Strategy.checkpoint_every).
    gradient_checkpointing: bool | None = None
    # The training shape with the most pixels: what memory is sized for.
    resolution: tuple[int, int] = (1024, 1024)
    # Aspect buckets: (width, height, samples) of every training shape, an image at each size being one sample;
    # empty: every instance image once at `resolution`. Time and caching follow this mix.
    bucket_mix: tuple[tuple[int, int, int], ...] = ()
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    steps: int = 1000
    optimizer: str = "adamw"
    # Whether the request named its optimizer: one left to its default lets a full fine-tune run Adafactor fused
    # into the backward pass (Strategy.fused_backward_pass) where that is the fastest strategy that fits.
    optimizer_named: bool = False
    # The request's fused_backward_pass: "auto" (the planner's choice), True (only it), False (never it).
    fused_backward_pass: bool | str = "auto"
    with_prior_preservation: bool = False
    num_class_images: int = 0
    # Instance images: unknown before the dataset is fetched, so the planner assumes the dataset cap.
    num_instance_images: int = DatasetLimits.max_images
    checkpointing_steps: int | None = None
    # Prompt tokens memory and time are sized for: 512, the most any family samples with (schnell's 256 is
    # left as margin).
    max_sequence_length: int = 512
    # The request's own timeout_seconds; None: the endpoint's deadline, which callers pass to choose_plan.
    timeout_seconds: int | None = None
    validation_prompts: int = 0
    validation_steps: int | None = None
    # The model's sampling steps (the spec's: schnell 4, dev 28); a hand-built shape budgets for dev's.
    validation_inference_steps: int = GUIDANCE_DISTILLED_SAMPLING.inference_steps
    class_image_inference_steps: int = GUIDANCE_DISTILLED_SAMPLING.inference_steps
    # An EMA of the trained weights (the request's ema_decay): host RAM, and a second export.
    ema: bool = False
    # Bytes of the base model still to download before training (0: cached on the worker), and the worker's rates.
    download_bytes: int = 0
    transfer_rates: TransferRates = TransferRates()
    # Seconds the trainer spends JIT-building DeepSpeed ops not yet built for this environment (host/op_cache.py),
    # while it loads: 0 when they are built.
    op_build_seconds: float = 0.0
    # The request's learning_check: the loss at fixed noise measured before and after training (extra forward passes).
    learning_check: bool = False
    # Likeness scoring (the spec's): a round of base-model renders before the first step, the scoring process
    # after training; and with keep_best_step a LoRA saved at every validation step, two LoRAs uploaded.
    likeness: bool = False
    keep_best_step: bool = False
    # `captioning: "missing"`: the captioning process before the trainer, planned for every photo, priced by the
    # captioner's weights (contract.captioning.captioner_bytes); 0: no captioning.
    captioner_bytes: int = 0

    @classmethod
    def from_spec(
        cls, spec: JobSpec, *, instance_images: int, bucket_mix: Mapping[tuple[int, int], int] | None = None
    ) -> JobShape:
        """The job `spec` as the planner reads it. The spec does not say how many images its dataset holds:
        `instance_images` is the caller's bound (the dataset cap before the dataset is fetched), `bucket_mix`
        the samples per training shape once the images are known (before: every image at each size, as a
        size x size square)."""
        images = max(1, int(instance_images))
        resolution, mix = _training_shapes(spec.resolution, images, bucket_mix)
        return cls(
            training_type=spec.training_type,
            lora_rank=spec.lora.rank,
            lora_targets=spec.lora.target_modules,
            base_precision=spec.base_precision,
            zero_stage=spec.zero_stage,
            offload=spec.offload,
            use_deepspeed=spec.use_deepspeed,
            mixed_precision=spec.mixed_precision,
            gradient_checkpointing=spec.gradient_checkpointing,
            resolution=resolution,
            bucket_mix=mix,
            batch_size=spec.optimisation.batch_size,
            gradient_accumulation_steps=spec.optimisation.gradient_accumulation_steps,
            steps=spec.optimisation.steps,
            optimizer=spec.optimisation.optimizer,
            optimizer_named=spec.optimizer_named,
            fused_backward_pass=spec.fused_backward_pass,
            with_prior_preservation=spec.prompts.with_prior_preservation,
            num_class_images=spec.planned_class_images,
            num_instance_images=images,
            checkpointing_steps=spec.checkpointing_steps,
            timeout_seconds=spec.deadline_seconds if spec.deadline_from_request else None,
            validation_prompts=len(spec.validation_prompts),
            validation_steps=spec.validation_steps,
            validation_inference_steps=spec.sampling.validation_inference_steps,
            class_image_inference_steps=spec.sampling.class_image_inference_steps,
            ema=spec.optimisation.ema_decay is not None,
            learning_check=spec.measure_fixed_noise_loss,
            likeness=spec.likeness,
            keep_best_step=spec.keep_best_step,
            captioner_bytes=captioner_bytes(spec.captioner) if spec.captioner else 0,
        )

    @property
    def training_mix(self) -> tuple[tuple[tuple[int, int], int], ...]:
        """(shape, samples) of every training shape."""
        if not self.bucket_mix:
            return ((self.resolution, self.num_instance_images),)
        return tuple(((width, height), samples) for width, height, samples in self.bucket_mix)

    @property
    def samples_per_micro_step(self) -> int:
        # Prior preservation concatenates a class image to every instance image.
        return self.batch_size * (2 if self.with_prior_preservation else 1)

    @property
    def validation_rounds_during_training(self) -> int:
        """Rounds of validation renders between steps: every validation_steps, short of the last step."""
        if not self.validation_prompts or not self.validation_steps or self.validation_steps >= self.steps:
            return 0
        return (self.steps - 1) // self.validation_steps

    @property
    def validation_rounds(self) -> int:
        """How many times the validation prompts are rendered: before the first step when likeness is scored
        (the base model), every validation_steps, and at the end."""
        if not self.validation_prompts:
            return 0
        return (1 if self.likeness else 0) + self.validation_rounds_during_training + 1


def _training_shapes(
    resolution: Resolution, images: int, real_mix: Mapping[tuple[int, int], int] | None
) -> tuple[tuple[int, int], tuple[tuple[int, int, int], ...]]:
    """(the shape memory is sized for, the bucket mix) of a spec's `resolution`."""
    if resolution.fixed is not None:
        return resolution.fixed, ()
    if real_mix:
        mix = tuple(sorted((width, height, samples) for (width, height), samples in real_mix.items()))
    else:
        # Every bucket holds about size² pixels (rounding its sides to 16 moves that by a few per cent, within
        # the planner's margins); the re-plan with the prepared images sizes for their real largest bucket.
        mix = tuple((size, size, images) for size in resolution.sizes)
    largest = max(mix, key=lambda entry: (entry[0] * entry[1], entry[0]))
    return (largest[0], largest[1]), mix


@dataclass(frozen=True)
class Strategy:
    training_type: str
    use_deepspeed: bool
    zero_stage: int
    offload_optimizer: Offload
    offload_param: Offload
    base_precision: str = "bf16"
    # The frozen base's blocks live in pinned host RAM and stream to the GPU as the passes need them
    # (fluxbooth.train.blockswap), two at a time; LoRA with gradient checkpointing, without ZeRO-3, or the fused
    # full fine-tune's trained blocks (written back to host RAM after each block's backward).
    block_swap: bool = False
    # Activation checkpointing: every k-th block of the double and of the single stack keeps only its inputs and
    # is recomputed in the backward (contract.settings_groups.checkpointed_blocks); 0 none, 1 every block (what
    # block swapping needs).
    checkpoint_every: int = 1
    # kohya's FLUX full fine-tune (--fused_backward_pass --full_bf16): bf16 weights without an fp32 master copy,
    # each stepped by Adafactor inside the backward pass (no gradient buffer); one process, no DeepSpeed.
    fused_backward_pass: bool = False

    @property
    def quantised(self) -> bool:
        return self.base_precision in QUANTISED_PRECISIONS

    def describe(self) -> str:
        if self.fused_backward_pass:
            swapped_blocks = ", trained blocks swapped in from host RAM" if self.block_swap else ""
            swapped_blocks += self.describe_checkpointing()
            return f"full fine-tune with Adafactor fused into the backward pass (bf16 weights), without DeepSpeed{swapped_blocks}"
        kind = "full fine-tune" if self.training_type == "full" else "LoRA"
        if self.quantised:
            kind += f" over an {self.base_precision} base"
        swapped = ", frozen blocks swapped in from host RAM" if self.block_swap else ""
        swapped += self.describe_checkpointing()
        if not self.use_deepspeed:
            return f"{kind} without DeepSpeed{swapped}"
        offloads = []
        if self.offload_optimizer != "none":
            offloads.append(f"optimizer to {self.offload_optimizer}")
        if self.offload_param != "none":
            offloads.append(f"parameters to {self.offload_param}")
        where = f", offload {' and '.join(offloads)}" if offloads else ", no offload"
        return f"{kind} with ZeRO-{self.zero_stage}{where}{swapped}"

    def describe_checkpointing(self) -> str:
        """Said only when it is not the established every block."""
        if self.checkpoint_every == 1:
            return ""
        if self.checkpoint_every == 0:
            return ", no activation checkpointing"
        return f", every {ordinal(self.checkpoint_every)} block checkpointed"


def ordinal(number: int) -> str:
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


@dataclass(frozen=True)
class MemoryEstimate:
    gpu_bytes: int  # per GPU, the peak over all phases
    host_bytes: int  # the whole node (all processes), the peak over all phases
    disk_bytes: int  # work dir plus offload swap
    nvme_bytes: int  # the part of disk_bytes that lives on the offload path
    breakdown: dict[str, float]  # docs/memory.md's terms in bytes (a measured fraction may leave a part byte)
    cache_encoders_on_cpu: bool
    phase_gpu_bytes: dict[str, int] = field(default_factory=dict)
    phase_host_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    estimate: MemoryEstimate
    seconds_per_step: float
    fits: bool
    reason: str
    lora_rank: int | None
    honours_request: bool
    relative_speed: float = 1.0
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return sum(self.phase_seconds.values())

    def phases(self) -> tuple[tuple[str, PhaseEstimate], ...]:
        return tuple(
            (
                name,
                PhaseEstimate(
                    gpu_bytes=int(self.estimate.phase_gpu_bytes.get(name, 0)),
                    host_bytes=int(self.estimate.phase_host_bytes.get(name, 0)),
                    seconds=round(self.phase_seconds.get(name, 0.0), 1),
                ),
            )
            for name in TIMED_PHASES
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "training_type": self.strategy.training_type,
            "base_precision": self.strategy.base_precision,
            "fused_backward_pass": self.strategy.fused_backward_pass,
            "use_deepspeed": self.strategy.use_deepspeed,
            "zero_stage": self.strategy.zero_stage,
            "offload_optimizer": self.strategy.offload_optimizer,
            "offload_param": self.strategy.offload_param,
            "block_swap": self.strategy.block_swap,
            "checkpoint_every": self.strategy.checkpoint_every,
            "lora_rank": self.lora_rank,
            "fits": self.fits,
            "gpu_bytes": self.estimate.gpu_bytes,
            "host_bytes": self.estimate.host_bytes,
            "disk_bytes": self.estimate.disk_bytes,
            "seconds_per_step": round(self.seconds_per_step, 3),
            "total_seconds": round(self.total_seconds),
            "relative_speed": round(self.relative_speed, 3),
            "honours_request": self.honours_request,
            "reason": self.reason,
            "phases": {name: asdict(phase) for name, phase in self.phases()},
            "breakdown": dict(self.estimate.breakdown),
        }
