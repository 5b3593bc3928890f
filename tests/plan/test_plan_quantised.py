"""The planner for LoRA over a quantised base (issue 11): sizes, candidates, GPU table, phases, refusals."""

from __future__ import annotations

import pytest

from fluxbooth.contract.precision import is_quantised_layer
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.host.pinned import block_store_layout, block_store_pinned_bytes
from fluxbooth.plan import JobShape, Strategy, choose_plan, frozen_base_bytes
from fluxbooth.plan.candidates import evaluate_candidates, strategies_for
from fluxbooth.plan.gpus import gpu_spec
from fluxbooth.plan.host_buffers import block_tensor_bytes
from fluxbooth.plan.memory import estimate_memory, frozen_block_bytes, layer_being_quantised
from fluxbooth.plan.timing import step_terms
from fluxbooth.sizing import FLUX_DEV_NAME, ModelSize, model_size

RTX_4090 = "NVIDIA GeForce RTX 4090"


@pytest.fixture(scope="module")
def flux_dev() -> ModelSize:
    return model_size(FLUX_DEV_NAME)


def card(gpu_gib: float, name: str, host_gib: float = 62) -> Hardware:
    return hypothetical_hardware(
        gpus=1,
        gpu_memory_bytes=int(gpu_gib * GIB),
        host_memory_bytes=int(host_gib * GIB),
        disk_bytes=200 * GIB,
        gpu_name=name,
    )


def lora(**fields: object) -> JobShape:
    """FLUX.1-dev rank-16 LoRA at 1024², 1000 steps, sized for four photos."""
    return JobShape(**{"training_type": "lora", "num_instance_images": 4, **fields})  # type: ignore[arg-type]


# ---- sizes of a quantised base ---------------------------------------------------------------------


def quantised_and_other_elements(model: ModelSize) -> tuple[int, int]:
    quantised = sum(
        layer.in_features * layer.out_features for layer in model.linear_layers if is_quantised_layer(layer.name)
    )
    return quantised, model.transformer_params - quantised


def test_an_fp8_base_stores_a_byte_per_block_weight_and_a_scale_per_output_channel(flux_dev: ModelSize) -> None:
    quantised, other = quantised_and_other_elements(flux_dev)
    outputs = sum(layer.out_features for layer in flux_dev.linear_layers if is_quantised_layer(layer.name))
    assert frozen_base_bytes(flux_dev, "fp8", 2) == {
        "frozen_weights_quantised": quantised + 4 * outputs,
        "frozen_weights_unquantised": 2 * other,
    }


def test_an_nf4_base_stores_half_a_byte_plus_the_double_quantised_absmax(flux_dev: ModelSize) -> None:
    quantised, other = quantised_and_other_elements(flux_dev)
    sizes = frozen_base_bytes(flux_dev, "nf4", 2)
    layers = sum(1 for layer in flux_dev.linear_layers if is_quantised_layer(layer.name))
    tables = layers * 4 * (16 + 256)  # each layer's NF4 values and dynamic map, fp32
    assert sizes["frozen_weights_quantised"] == int(quantised * (4 + 8 / 64 + 32 / (64 * 256)) / 8 + tables)
    assert sizes["frozen_weights_unquantised"] == 2 * other


def test_the_embedders_and_final_layers_stay_unquantised(flux_dev: ModelSize) -> None:
    kept = {layer.name for layer in flux_dev.linear_layers if not is_quantised_layer(layer.name)}
    assert {"context_embedder", "x_embedder", "norm_out.linear", "proj_out"} <= kept
    assert not any(name.startswith(("transformer_blocks.", "single_transformer_blocks.")) for name in kept)


# ---- issue 11's planner targets ----------------------------------------------------------------------


def seconds_per_step_of(job: JobShape, hardware: Hardware, model: ModelSize, base: str, *, block_swap: bool) -> float:
    """The fastest fitting candidate's step time over `base`, swapped or whole on the GPU."""
    return min(
        candidate.seconds_per_step
        for candidate in evaluate_candidates(job, hardware, model)
        if candidate.fits
        and candidate.honours_request
        and (candidate.strategy.base_precision, candidate.strategy.block_swap) == (base, block_swap)
    )


def test_a_24_gib_rtx_4090_streams_a_bf16_base_faster_than_an_fp8_base_whole_on_the_gpu(flux_dev: ModelSize) -> None:
    # 1024²: the blocks' transfer (≈2.4 s a step over PCIe 4.0) hides behind the compute (≈2.9 s), fp8 pays ≈0.9 s
    # of dequantisation a step.
    plan = choose_plan(lora(), card(24, RTX_4090), flux_dev)
    assert (plan.base_precision, plan.block_swap, plan.offload_param, plan.offload_optimizer) == (
        "bf16",
        True,
        "none",
        "none",
    )
    assert plan.predicted_seconds_per_step is not None
    assert plan.predicted_seconds_per_step < seconds_per_step_of(
        lora(), card(24, RTX_4090), flux_dev, "fp8", block_swap=False
    )


def test_a_16_gib_a4000_at_1024_gets_no_parameter_offload_and_a_base_faster_than_nf4(flux_dev: ModelSize) -> None:
    plan = choose_plan(lora(), card(16, "NVIDIA RTX A4000"), flux_dev)
    assert (plan.base_precision, plan.block_swap, plan.zero_stage, plan.offload_param) == ("bf16", True, 2, "none")
    assert plan.predicted_seconds_per_step is not None
    assert plan.predicted_seconds_per_step < seconds_per_step_of(
        lora(), card(16, "NVIDIA RTX A4000"), flux_dev, "nf4", block_swap=False
    )


@pytest.mark.parametrize(("gib", "name"), [(48, "NVIDIA RTX A6000"), (80, "NVIDIA H100 80GB HBM3")])
def test_48_and_80_gib_cards_need_no_quantisation(flux_dev: ModelSize, gib: int, name: str) -> None:
    plan = choose_plan(lora(), card(gib, name, host_gib=94), flux_dev)
    assert (plan.base_precision, plan.offload_param) == ("bf16", "none")


def test_an_8_gib_card_with_32_gib_host_gets_a_512_plan_streaming_the_base_from_host_ram(flux_dev: ModelSize) -> None:
    # No quantised base fits 8 GiB whole (nf4 needs ≈8.4 GiB at 512²), and ZeRO-3's offloaded bf16 base needs
    # ≈31 GiB + 10 % of host RAM: the base's blocks stream from host RAM instead (docs/published_timings.md:
    # kohya's 8 GB recipe does the same with an fp8 base).
    plan = choose_plan(lora(resolution=(512, 512)), card(8, "NVIDIA RTX A4000", host_gib=32), flux_dev)
    assert (plan.training_type, plan.block_swap, plan.zero_stage, plan.offload_param) == ("lora", True, 2, "none")
    assert plan.predicted_gpu_bytes * 1.1 <= 8 * GIB
    assert plan.predicted_host_bytes * 1.1 <= 32 * GIB


def test_an_8_gib_card_with_62_gib_host_streams_the_bf16_base(flux_dev: ModelSize) -> None:
    plan = choose_plan(lora(resolution=(512, 512)), card(8, "NVIDIA RTX A4000"), flux_dev)
    assert (plan.base_precision, plan.block_swap, plan.offload_param) == ("bf16", True, "none")


def test_an_8_gib_card_at_1024_beyond_the_deadline_is_refused_naming_only_changes_the_trainer_runs(
    flux_dev: ModelSize,
) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(), card(8, "NVIDIA RTX A4000"), flux_dev, deadline_seconds=3300)
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert caught.value.message == (
        "steps: 1000 steps at ≈6.2 s/step with LoRA rank 16 with ZeRO-2, no offload, frozen blocks swapped in from "
        "host RAM, with every phase (training ≈104 min), take ≈1.7 h, beyond the job deadline of "
        "55 min; use about 521 steps, or timeout_seconds 7860 (and an endpoint execution timeout above it), "
        "or a faster GPU"
    )


def test_a_refusal_names_the_headroom_that_a_need_below_the_available_memory_still_lacks(flux_dev: ModelSize) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(resolution=(512, 512)), card(8, "NVIDIA RTX A4000", host_gib=13), flux_dev)
    assert caught.value.message == (
        "LoRA rank 16 of black-forest-labs/FLUX.1-dev at 512x512, batch 1, does not fit: this worker has 1x 8.0 GiB "
        "GPU and 13.0 GiB host RAM available. Closest: LoRA rank 16 over an nf4 base with ZeRO-2, no offload, frozen "
        "blocks swapped in from host RAM — needs ≈12.6 GiB host RAM + 10 % headroom, has 13.0 GiB available. No "
        "strategy fits; use a larger GPU or more host RAM"
    )


def test_a_requested_base_precision_is_honoured(flux_dev: ModelSize) -> None:
    plan = choose_plan(lora(base_precision="nf4"), card(80, "NVIDIA H100 80GB HBM3", host_gib=188), flux_dev)
    assert (plan.base_precision, plan.offload_param) == ("nf4", "none")


def test_a_full_fine_tune_over_a_quantised_base_is_invalid_input(flux_dev: ModelSize) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(JobShape(training_type="full", base_precision="nf4"), card(80, "NVIDIA H100 80GB HBM3"), flux_dev)
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "base_precision: 'nf4' stores a frozen base, and a full fine-tune trains every weight; use "
        "training_type 'lora' with it, or base_precision 'auto' or 'bf16'"
    )


def test_a_bf16_base_that_does_not_fit_is_refused_naming_the_precision_that_would(flux_dev: ModelSize) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(base_precision="bf16", offload="none"), card(24, RTX_4090), flux_dev)
    message = caught.value.message
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert (
        "The same job fits with base_precision 'auto' (LoRA rank 16 over an fp8 base with ZeRO-2, no offload)"
        in message
    )
    assert (
        "Closest: LoRA rank 16 with ZeRO-2, no offload — needs ≈26.7 GiB per GPU + 10 % headroom, has 24.0 GiB"
        in message
    )


def test_a_refusal_never_suggests_lora_to_a_lora_job(flux_dev: ModelSize) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(resolution=(512, 512)), card(2, "NVIDIA RTX A4000", host_gib=8), flux_dev)
    assert caught.value.message.endswith("No strategy fits; use a larger GPU or more host RAM")


# ---- the GPU table ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nvml_name", "row"),
    [
        ("NVIDIA RTX A4000", "RTX A4000"),
        ("NVIDIA RTX A4500", "RTX A4500"),
        ("NVIDIA RTX A5000", "RTX A5000"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA A40", "A40"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
        ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
        ("NVIDIA GeForce RTX 5090", "GeForce RTX 5090"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM"),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe"),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_every_gpu_runpod_rents_is_matched_on_its_nvml_name(nvml_name: str, row: str) -> None:
    spec = gpu_spec(nvml_name)
    assert spec is not None and spec.name == row


def test_an_unknown_gpu_is_planned_with_a_warning(flux_dev: ModelSize) -> None:
    plan = choose_plan(lora(), card(24, "NVIDIA GeForce RTX 3070"), flux_dev)
    assert (
        "GPU 'NVIDIA GeForce RTX 3070' is not in the planner's table; times assume an RTX A4000-class card "
        "(76.7 TFLOPS bf16, PCIe 4.0), so they may be far off"
    ) in plan.warnings


# ---- phases --------------------------------------------------------------------------------------------


def test_the_plan_carries_memory_and_time_for_every_phase(flux_dev: ModelSize) -> None:
    job = lora(with_prior_preservation=True, num_class_images=10, validation_prompts=2, likeness=True)
    plan = choose_plan(job, card(24, RTX_4090), flux_dev)
    phases = plan.to_dict()["phases"]
    assert list(phases) == [
        "download",
        "captioning",
        "loading",
        "caching",
        "class_images",
        "training",
        "validation",
        "export",
        "scoring",
        "report",
        "upload",
    ]
    # The job captions nothing: its captioning phase costs nothing.
    assert phases["captioning"] == {"gpu_bytes": 0, "host_bytes": 0, "seconds": 0.0}
    trainer_phases = {name: phase for name, phase in phases.items() if name not in ("download", "captioning", "upload")}
    assert all(phase["seconds"] > 0 and phase["host_bytes"] > 0 for phase in trainer_phases.values())
    # A cached base model has nothing to download; the adapter is uploaded.
    assert (phases["download"]["seconds"], phases["upload"]["seconds"] > 0) == (0, True)
    assert max(phase["gpu_bytes"] for phase in phases.values()) == plan.predicted_gpu_bytes
    assert plan.predicted_total_seconds == pytest.approx(sum(phase["seconds"] for phase in phases.values()), abs=1)


def test_renders_keep_the_base_as_training_holds_it_within_the_plan(flux_dev: ModelSize) -> None:
    plan = choose_plan(
        lora(with_prior_preservation=True, num_class_images=10, validation_prompts=2),
        card(16, "NVIDIA RTX A4000"),
        flux_dev,
    )
    phases = dict(plan.phases)
    # The 22 GiB bf16 transformer would not fit a 16 GiB card whole: renders stream its blocks as training does.
    assert (plan.base_precision, plan.block_swap) == ("bf16", True)
    assert phases["class_images"].gpu_bytes < 16 * GIB / 1.1
    assert phases["validation"].gpu_bytes < 16 * GIB / 1.1


def test_two_24_gib_cards_charge_their_renders_as_the_training_placement_not_a_whole_transformer(
    flux_dev: ModelSize,
) -> None:
    two_cards = hypothetical_hardware(
        gpus=2, gpu_memory_bytes=24 * GIB, host_memory_bytes=62 * GIB, disk_bytes=200 * GIB, gpu_name="NVIDIA L4"
    )
    plan = choose_plan(
        lora(with_prior_preservation=True, num_class_images=10, validation_prompts=2), two_cards, flux_dev
    )
    phases = dict(plan.phases)
    whole_bf16_transformer = 2 * flux_dev.transformer_params
    # The trainer renders class images and validation prompts through the engine as training placed it.
    assert phases["class_images"].gpu_bytes == phases["validation"].gpu_bytes <= phases["training"].gpu_bytes
    assert phases["validation"].gpu_bytes < whole_bf16_transformer
    assert plan.predicted_gpu_bytes < 24 * GIB / 1.1


def test_thousands_of_class_images_beyond_the_deadline_are_refused_naming_the_count_that_fits(
    flux_dev: ModelSize,
) -> None:
    job = lora(steps=100, with_prior_preservation=True, num_class_images=10_000)
    with pytest.raises(FluxboothError) as caught:
        choose_plan(job, card(80, "NVIDIA H100 80GB HBM3", host_gib=188), flux_dev, deadline_seconds=3300)
    assert caught.value.code is ErrorCode.DOES_NOT_FIT
    assert "class images ≈" in caught.value.message
    assert "num_class_images about " in caught.value.message


def test_validation_every_step_beyond_the_deadline_is_refused_naming_the_validation_settings(
    flux_dev: ModelSize,
) -> None:
    job = lora(steps=1000, validation_prompts=8, validation_steps=1)
    with pytest.raises(FluxboothError) as caught:
        choose_plan(job, card(80, "NVIDIA H100 80GB HBM3", host_gib=188), flux_dev, deadline_seconds=3300)
    assert (
        "fewer validation_prompts (8 now; [] renders none) or a larger validation_steps (1000 rounds of renders now)"
        in caught.value.message
    )


# ---- only what the trainer runs -----------------------------------------------------------------------


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_a_quantised_base_is_a_candidate_only_whole_on_the_gpu_under_zero2(base: str) -> None:
    assert strategies_for("lora", True, True, base) == [
        Strategy("lora", True, 2, "none", "none", base),
        Strategy("lora", True, 2, "cpu", "none", base),
    ]


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_a_quantised_base_without_deepspeed_is_one_candidate_whole_on_the_gpu(base: str) -> None:
    assert strategies_for("lora", False, False, base) == [Strategy("lora", False, 0, "none", "none", base)]


@pytest.mark.parametrize("base", ["bf16", "fp8", "nf4"])
def test_block_swapping_adds_a_candidate_per_optimizer_placement_under_zero2_only(base: str) -> None:
    swapped = [
        strategy for strategy in strategies_for("lora", True, True, base, block_swap=True) if strategy.block_swap
    ]
    assert swapped == [
        Strategy("lora", True, 2, optimizer, "none", base, block_swap=True) for optimizer in ("none", "cpu")
    ]


def test_a_full_fine_tune_gets_no_block_swapped_candidate() -> None:
    assert not any(strategy.block_swap for strategy in strategies_for("full", True, True, block_swap=True))


def test_a_block_swapped_base_keeps_two_of_its_largest_blocks_on_the_gpu_and_every_block_in_host_ram(
    flux_dev: ModelSize,
) -> None:
    strategy = Strategy("lora", True, 2, "none", "none", "fp8", block_swap=True)
    estimate = estimate_memory(strategy, flux_dev, lora(), card(8, "NVIDIA RTX A4000"), "bf16")
    blocks = block_tensor_bytes(flux_dev, "fp8", 2)
    assert len(blocks) == 19 + 38  # FLUX.1-dev's double- and single-stream blocks
    assert estimate.breakdown["gpu.swapped_blocks"] == 2 * max(
        block_store_layout(sizes)[1] for sizes in blocks.values()
    )
    assert estimate.breakdown["host.frozen_blocks_pinned"] == sum(
        block_store_pinned_bytes(sizes) for sizes in blocks.values()
    )
    assert "gpu.frozen_weights_quantised" not in estimate.breakdown


def test_on_a_4090_at_1024_block_swapping_costs_only_each_passs_first_block(flux_dev: ModelSize) -> None:
    # Forward and recompute each stream every block (2 x 23.7 GB at 20 GB/s over PCIe 4.0 ≈ 2.4 s), hidden behind
    # ≈2.9 s of compute; the first block of each pass has nothing to hide behind.
    strategy = Strategy("lora", True, 2, "none", "none", "bf16", block_swap=True)
    terms = step_terms(strategy, flux_dev, lora(), card(24, RTX_4090), 10**7, 2)
    largest_block = max(frozen_block_bytes(flux_dev, "bf16", 2).values())
    assert terms["compute"] > 2 * sum(frozen_block_bytes(flux_dev, "bf16", 2).values()) / 20e9
    assert terms["swapping"] == pytest.approx(2 * largest_block / 20e9)


def test_a_quantised_base_under_zero3_is_invalid_input(flux_dev: ModelSize) -> None:
    with pytest.raises(FluxboothError) as caught:
        choose_plan(lora(base_precision="fp8", zero_stage=3), card(24, RTX_4090), flux_dev)
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "zero_stage: a fp8 base stays whole on each GPU, and ZeRO-3 would partition it; "
        "use zero_stage 2 or 'auto', or base_precision 'bf16'"
    )


# ---- loading a quantised base --------------------------------------------------------------------------

LARGEST_FLUX_LAYER = 3072 * 18432  # a double block's norm1.linear (six modulations), the largest quantised Linear


@pytest.mark.parametrize(("base", "working"), [("fp8", 8), ("nf4", 16)])
def test_quantising_a_layer_holds_its_bf16_weight_and_the_quantisers_working_copies(
    flux_dev: ModelSize, base: str, working: int
) -> None:
    assert layer_being_quantised(flux_dev, base, 2) == LARGEST_FLUX_LAYER * (2 + working)


@pytest.mark.parametrize("base", ["fp8", "nf4"])
def test_the_loading_peak_is_the_stored_base_and_one_layer_being_quantised(flux_dev: ModelSize, base: str) -> None:
    candidate = next(
        c
        for c in evaluate_candidates(
            lora(base_precision=base), card(24, RTX_4090), flux_dev, include_alternatives=False
        )
        if c.strategy == Strategy("lora", True, 2, "none", "none", base)
    )
    gpu = {name[4:]: value for name, value in candidate.estimate.breakdown.items() if name.startswith("gpu.")}
    loaded = (
        gpu["weights_16bit"] + gpu["frozen_weights_quantised"] + gpu["frozen_weights_unquantised"] + gpu["cuda_context"]
    )
    assert candidate.estimate.phase_gpu_bytes["loading"] == loaded + layer_being_quantised(flux_dev, base, 2)
