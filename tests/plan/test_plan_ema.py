"""The CPU EMA's cost in the plan (fluxbooth.plan.ema, plan/memory/model_states.py): every step copies the trained weights to
the host and updates an fp32 shadow there, seconds a full fine-tune of FLUX.1 cannot hide and a LoRA never sees."""

from __future__ import annotations

import pytest

from fluxbooth.host.hardware import GIB, hypothetical_hardware
from fluxbooth.plan.ema import EMA_UPDATE_TRAFFIC_BYTES_PER_PARAM
from fluxbooth.plan.memory import estimate_memory
from fluxbooth.plan.timing import HOST_MEMORY_BYTES_PER_SECOND, host_link_bytes_per_second, step_terms
from fluxbooth.plan.types import JobShape, Strategy
from fluxbooth.sizing import model_size

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
FUSED_FULL = Strategy("full", False, 0, "none", "none", fused_backward_pass=True)
H100 = hypothetical_hardware(
    gpus=1, gpu_memory_bytes=80 * GIB, host_memory_bytes=256 * GIB, disk_bytes=500 * GIB, gpu_name="H100 SXM"
)


def test_a_step_without_ema_pays_nothing_for_it() -> None:
    model = model_size(FLUX_DEV)
    assert (
        step_terms(FUSED_FULL, model, JobShape(training_type="full"), H100, model.transformer_params, 2)["ema"] == 0.0
    )


def test_a_full_finetunes_ema_pays_the_weights_over_the_host_link_and_the_shadows_traffic_every_step() -> None:
    model = model_size(FLUX_DEV)
    terms = step_terms(FUSED_FULL, model, JobShape(training_type="full", ema=True), H100, model.transformer_params, 2)
    weights = model.transformer_params
    expected = (
        2 * weights / host_link_bytes_per_second(H100)
        + weights * (2 + EMA_UPDATE_TRAFFIC_BYTES_PER_PARAM) / HOST_MEMORY_BYTES_PER_SECOND
    )
    assert terms["ema"] == pytest.approx(expected, rel=1e-12)
    assert terms["ema"] > sum(value for name, value in terms.items() if name != "ema")  # it dominates the step


def test_a_loras_ema_costs_hundredths_of_a_second() -> None:
    model = model_size(FLUX_DEV)
    terms = step_terms(
        Strategy("lora", True, 2, "none", "none"), model, JobShape(ema=True), H100, model.lora_params(16, ("to_q",)), 2
    )
    assert 0.0 < terms["ema"] < 0.05


def test_the_ema_holds_its_fp32_shadow_and_one_weight_in_flight_on_the_host() -> None:
    model = model_size(FLUX_DEV)
    estimate = estimate_memory(FUSED_FULL, model, JobShape(training_type="full", ema=True), H100, "bf16")
    largest = max(layer.in_features * layer.out_features for layer in model.linear_layers)
    assert estimate.breakdown["host.ema_shadow"] == 4 * model.transformer_params
    assert estimate.breakdown["host.ema_update_working"] == 6 * largest
