"""The planner and the fused Adafactor full fine-tune (Strategy.fused_backward_pass; the trainer's
train/fused_adafactor.py): when it is a candidate, what it needs per phase, the plans it gives FLUX.1-dev on
the RunPod tiers, the refusals that name it, and the trainer input it becomes. No torch, no trainer runs."""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from fluxbooth.cli import main
from fluxbooth.contract.names import FUSED_ADAFACTOR_CLASS, FUSED_ADAFACTOR_LEARNING_RATE
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.host.hardware import GIB, Hardware, hypothetical_hardware
from fluxbooth.host.pinned import block_store_layout, block_store_pinned_bytes
from fluxbooth.job.launch_files import deepspeed_config, trainer_config_for, write_launch_files
from fluxbooth.plan import choose_plan, estimate_memory, evaluate_candidates, model_size
from fluxbooth.plan.candidates import FUSED_STRATEGY, FUSED_SWAP_STRATEGY
from fluxbooth.plan.host_buffers import block_tensor_bytes
from fluxbooth.plan.memory import FUSED_STEP_BYTES_PER_PARAM, adafactor_state_bytes, frozen_block_bytes
from fluxbooth.plan.timing import host_link_bytes_per_second, step_terms
from fluxbooth.plan.types import JobShape
from fluxbooth.request.limits import MAX_TIMEOUT_SECONDS
from fluxbooth.request.model import parse_request
from fluxbooth.request.spec import JobSpec
from tests.support.specs import job_spec

FLUX_DEV = "black-forest-labs/FLUX.1-dev"
# An endpoint set up for hour-long jobs (execution timeout 3600 s, FLUXBOOTH_JOB_DEADLINE_SECONDS 3300).
WORKER_DEADLINE_SECONDS = 55 * 60


def card(gpu_gib: float, host_gib: float, name: str, gpus: int = 1) -> Hardware:
    return hypothetical_hardware(
        gpus=gpus,
        gpu_memory_bytes=int(gpu_gib * GIB),
        host_memory_bytes=int(host_gib * GIB),
        disk_bytes=500 * GIB,
        cpu_count=16,
        gpu_name=name,
    )


def full_spec(**fields: Any) -> JobSpec:
    """The guide's full fine-tune at 1024x1024, as the worker resolves it (its optimizer left to the planner)."""
    return job_spec(
        parse_request(
            {
                "model_name": "m",
                "dataset": "UEsFBgAAAAAAAAAAAAAAAAAAAAAAAA==",
                "instance_prompt": "a photo of sks person",
                "training_type": "full",
                "resolution": "1024x1024",
                "steps": 1000,
                **fields,
            }
        )
    )


def plan_for(hardware: Hardware, deadline: float = MAX_TIMEOUT_SECONDS, **fields: Any) -> Any:
    return choose_plan(full_spec(**fields), hardware, model_size(FLUX_DEV), deadline_seconds=deadline)


# ---- the RunPod tiers -----------------------------------------------------------------------------------


def run_plan_cli(arguments: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "FLUXBOOTH_WORK_DIR": str(tmp_path / "work"),
        "FLUXBOOTH_OUTPUT_DIR": str(tmp_path / "out"),
        "FLUXBOOTH_CACHE_DIR": str(tmp_path / "cache"),
        "FLUXBOOTH_VOLUME_DIR": str(tmp_path / "no-volume"),
        "HF_HUB_OFFLINE": "1",
    }
    out = io.StringIO()
    deadline = [] if "--deadline" in arguments else ["--deadline", str(WORKER_DEADLINE_SECONDS)]
    code = main(["plan", *arguments, *deadline, "--json"], environ, out)
    return code, json.loads(out.getvalue())


def test_plan_chooses_the_fused_pass_for_flux_dev_on_an_80_gib_h100_with_188_gib_host(tmp_path: Path) -> None:
    code, report = run_plan_cli(
        [
            "--training-type",
            "full",
            "--resolution",
            "1024",
            "--gpus",
            "1",
            "--gpu-memory",
            "80GiB",
            "--host-memory",
            "188GiB",
            "--cpus",
            "16",
            "--disk",
            "500GiB",
            "--gpu-name",
            "H100 SXM",
        ],
        tmp_path,
    )

    assert code == 0
    plan = report["plan"]
    assert (plan["training_type"], plan["fused_backward_pass"], plan["use_deepspeed"]) == ("full", True, False)
    assert plan["optimizer"] == FUSED_ADAFACTOR_CLASS
    assert plan["predicted_gpu_bytes"] * 1.1 <= 80 * GIB and plan["predicted_host_bytes"] * 1.1 <= 188 * GIB
    assert report["chosen"]["fused_backward_pass"] is True
    # Every AdamW full fine-tune needs more: 225 GiB of GPU, or 231 GiB of host RAM with the optimizer offloaded.
    others = [
        candidate
        for candidate in report["candidates"]
        if candidate["training_type"] == "full" and not candidate["fused_backward_pass"]
    ]
    assert others and not any(candidate["fits"] for candidate in others)


def test_the_fused_pass_plans_on_the_48_gib_tier_too() -> None:
    plan = plan_for(card(48, 188, "RTX A6000"))

    assert plan.fused_backward_pass and plan.optimizer == FUSED_ADAFACTOR_CLASS
    assert plan.predicted_gpu_bytes * 1.1 <= 48 * GIB


def test_the_24_gib_tier_plans_the_fused_pass_with_its_trained_blocks_swapped() -> None:
    plan = plan_for(card(24, 62, "NVIDIA GeForce RTX 4090"))

    assert (plan.fused_backward_pass, plan.block_swap, plan.use_deepspeed) == (True, True, False)
    assert plan.predicted_gpu_bytes * 1.1 <= 24 * GIB and plan.predicted_host_bytes * 1.1 <= 62 * GIB


def test_the_plan_command_gives_the_24_gib_tier_the_swapped_fused_pass(tmp_path: Path) -> None:
    code, report = run_plan_cli(
        [
            "--base-model",
            FLUX_DEV,
            "--training-type",
            "full",
            "--resolution",
            "1024",
            "--gpus",
            "1",
            "--gpu-memory",
            "24GiB",
            "--host-memory",
            "62GiB",
            "--cpus",
            "16",
            "--disk",
            "200GiB",
            "--deadline",
            str(MAX_TIMEOUT_SECONDS),
        ],
        tmp_path,
    )

    assert code == 0
    assert (report["plan"]["fused_backward_pass"], report["plan"]["block_swap"]) == (True, True)


def test_the_24_gib_tier_with_32_gib_of_host_ram_is_refused_with_the_swapped_blocks_host_need() -> None:
    with pytest.raises(FluxboothError) as refused:
        plan_for(card(24, 32, "NVIDIA GeForce RTX 4090"))

    message = refused.value.message
    assert refused.value.code is ErrorCode.DOES_NOT_FIT
    needs = re.search(
        r"Closest: full fine-tune with Adafactor fused into the backward pass \(bf16 weights\), without DeepSpeed, trained "
        r"blocks swapped in from host RAM — needs ≈(\d+\.\d) GiB host RAM \+ 10 % headroom, has 32\.0 GiB available\.",
        message,
    )
    assert needs, message
    # The pinned bf16 blocks alone are 22.0 GiB; the export reloads the 22.2 GiB it saved.
    assert float(needs.group(1)) > 2 * 2 * model_size(FLUX_DEV).transformer_params / GIB


def test_the_80_gib_card_keeps_every_weight_on_the_gpu_though_swapping_would_fit() -> None:
    candidates = evaluate_candidates(full_spec(), card(80, 188, "H100 SXM"), model_size(FLUX_DEV))
    (swapped,) = [c for c in candidates if c.strategy == FUSED_SWAP_STRATEGY]

    plan = plan_for(card(80, 188, "H100 SXM"))
    assert (plan.fused_backward_pass, plan.block_swap) == (True, False)
    assert swapped.fits and swapped.seconds_per_step > plan.predicted_seconds_per_step


def test_the_swapped_fused_pass_holds_two_trained_blocks_on_the_gpu_and_pins_every_block() -> None:
    model = model_size(FLUX_DEV)
    tensors = block_tensor_bytes(model, "bf16", 2)
    estimate = estimate_memory(
        FUSED_SWAP_STRATEGY, model, JobShape(training_type="full"), card(24, 62, "NVIDIA GeForce RTX 4090"), "bf16"
    )

    # Two device slots of the largest block's store: a write-back is queued on the copy stream before the copy
    # that reuses its slot, so the fused pass needs no third.
    assert estimate.breakdown["gpu.swapped_blocks"] == 2 * max(
        block_store_layout(sizes)[1] for sizes in tensors.values()
    )
    assert estimate.breakdown["gpu.weights_outside_blocks"] == 2 * model.transformer_params - sum(
        map(sum, tensors.values())
    )
    assert estimate.breakdown["host.trained_blocks_pinned"] == sum(
        block_store_pinned_bytes(sizes) for sizes in tensors.values()
    )
    assert estimate.breakdown["gpu.optimizer_states_factored"] == adafactor_state_bytes(model)
    assert estimate.breakdown["gpu.fused_step_working"] == FUSED_STEP_BYTES_PER_PARAM * model.largest_layer_params


def test_the_swapped_fused_step_pays_three_block_transfers_beyond_what_compute_hides() -> None:
    model, hardware = model_size(FLUX_DEV), card(24, 62, "NVIDIA GeForce RTX 4090")
    job = JobShape(training_type="full")
    terms = step_terms(FUSED_SWAP_STRATEGY, model, job, hardware, model.transformer_params, 2)
    blocks = frozen_block_bytes(model, "bf16", 2)
    link = host_link_bytes_per_second(hardware)

    expected = max(0.0, 3 * sum(blocks.values()) / link - terms["compute"]) + 2 * max(blocks.values()) / link
    assert terms["swapping"] == pytest.approx(expected, rel=1e-12)


def test_a_deadline_that_cannot_hold_1000_full_steps_says_how_many_fit() -> None:
    with pytest.raises(FluxboothError) as refused:
        plan_for(card(48, 188, "L40S"), deadline=WORKER_DEADLINE_SECONDS)

    message = refused.value.message
    match = re.search(
        r"^steps: 1000 steps at ≈(\d+\.\d) s/step with full fine-tune with Adafactor fused into the backward pass",
        message,
    )
    assert match, message
    fitting = int(re.search(r"use about (\d+) steps", message).group(1))
    assert 1 <= fitting < 1000
    assert fitting * float(match.group(1)) < WORKER_DEADLINE_SECONDS


# ---- when the fused pass is a candidate -------------------------------------------------------------------


def test_a_request_that_names_adamw_keeps_adamw_under_deepspeed() -> None:
    plan = plan_for(card(80, 384, "H100 SXM"), optimizer="adamw")

    assert not plan.fused_backward_pass
    assert (plan.zero_stage, plan.offload_optimizer, plan.optimizer) == (2, "cpu", "DeepSpeedCPUAdam")


def test_a_request_that_names_adafactor_gets_the_fused_pass() -> None:
    assert plan_for(card(80, 188, "H100 SXM"), optimizer="adafactor").fused_backward_pass


def test_the_fused_pass_is_faster_than_zero2_with_the_optimizer_offloaded_where_both_fit() -> None:
    plan = plan_for(card(80, 512, "H100 SXM"))

    assert plan.fused_backward_pass


def test_gradient_accumulation_rules_the_fused_pass_out_and_the_refusal_says_what_would_allow_it() -> None:
    with pytest.raises(FluxboothError) as refused:
        plan_for(card(80, 188, "H100 SXM"), gradient_accumulation_steps=2)

    assert (
        "The same job fits with gradient_accumulation_steps 1 (full fine-tune with Adafactor fused into the backward "
        "pass (bf16 weights), without DeepSpeed, no activation checkpointing)" in refused.value.message
    )


@pytest.mark.parametrize(
    ("fields", "change"),
    [
        ({"zero_stage": 2}, "zero_stage and offload 'auto'"),
        ({"offload": "cpu"}, "zero_stage and offload 'auto'"),
        ({"optimizer": "adamw"}, "optimizer 'adafactor' (or none)"),
    ],
)
def test_settings_the_fused_pass_cannot_honour_are_named_in_the_refusal(fields: dict[str, Any], change: str) -> None:
    with pytest.raises(FluxboothError) as refused:
        plan_for(card(80, 188, "H100 SXM"), **fields)

    assert f"The same job fits with {change} (full fine-tune with Adafactor fused" in refused.value.message


def test_fused_backward_pass_true_gets_the_fused_pass_where_zero2_with_the_optimizer_offloaded_fits_too() -> None:
    assert plan_for(card(80, 512, "H100 SXM"), fused_backward_pass=True).fused_backward_pass


def test_fused_backward_pass_false_keeps_deepspeed_where_the_fused_pass_would_be_faster() -> None:
    plan = plan_for(card(80, 512, "H100 SXM"), fused_backward_pass=False)

    assert not plan.fused_backward_pass
    assert (plan.use_deepspeed, plan.zero_stage, plan.offload_optimizer) == (True, 2, "cpu")


def test_fused_backward_pass_false_where_only_the_fused_pass_fits_is_refused_naming_the_field() -> None:
    with pytest.raises(FluxboothError) as refused:
        plan_for(card(80, 188, "H100 SXM"), fused_backward_pass=False)

    assert refused.value.code is ErrorCode.DOES_NOT_FIT
    assert (
        "The same job fits with fused_backward_pass 'auto' (full fine-tune with Adafactor fused into the backward "
        "pass (bf16 weights), without DeepSpeed, no activation checkpointing)" in refused.value.message
    )


def test_the_plan_command_passes_fused_backward_pass_false_to_the_planner(tmp_path: Path) -> None:
    code, report = run_plan_cli(
        [
            "--training-type",
            "full",
            "--fused-backward-pass",
            "false",
            "--deadline",
            "86400",
            "--gpus",
            "1",
            "--gpu-memory",
            "80GiB",
            "--host-memory",
            "512GiB",
            "--cpus",
            "16",
            "--disk",
            "500GiB",
            "--gpu-name",
            "H100 SXM",
        ],
        tmp_path,
    )

    assert code == 0
    assert (report["plan"]["fused_backward_pass"], report["plan"]["use_deepspeed"]) == (False, True)


def test_several_gpus_get_no_fused_candidate() -> None:
    candidates = evaluate_candidates(full_spec(), card(80, 512, "H100 SXM", gpus=2), model_size(FLUX_DEV))

    assert not any(candidate.strategy.fused_backward_pass for candidate in candidates)


def test_a_lora_request_shows_the_fused_full_fine_tune_as_an_alternative() -> None:
    lora = full_spec(training_type="lora")

    candidates = evaluate_candidates(lora, card(80, 188, "H100 SXM"), model_size(FLUX_DEV))

    (fused,) = [candidate for candidate in candidates if candidate.strategy == FUSED_STRATEGY]
    assert fused.fits and not fused.honours_request


# ---- memory and time per phase ----------------------------------------------------------------------------


def test_the_fused_pass_holds_bf16_weights_factored_states_and_one_layers_step_but_no_gradient_buffer() -> None:
    model = model_size(FLUX_DEV)
    estimate = estimate_memory(FUSED_STRATEGY, model, JobShape(training_type="full"), card(80, 188, "H100 SXM"), "bf16")

    gpu_terms = {
        name.removeprefix("gpu."): value for name, value in estimate.breakdown.items() if name.startswith("gpu.")
    }
    assert gpu_terms["weights_16bit"] == 2 * model.transformer_params
    assert gpu_terms["optimizer_states_factored"] == adafactor_state_bytes(model) < 64 * 2**20
    assert gpu_terms["fused_step_working"] == FUSED_STEP_BYTES_PER_PARAM * model.largest_layer_params
    assert not {"gradients", "optimizer_states_partition", "trainable_weights_grads_optimizer"} & set(gpu_terms)
    assert {"activations_saved", "activations_working", "cuda_context"} <= set(gpu_terms)
    # The states and the step exist only once training runs; loading holds the weights and one layer in flight.
    loading = estimate.phase_gpu_bytes["loading"]
    assert loading == gpu_terms["weights_16bit"] + gpu_terms["cuda_context"] + model.largest_layer_params * 2


def test_every_phase_of_the_fused_plan_has_memory_and_time() -> None:
    plan = plan_for(card(80, 188, "H100 SXM"))
    phases = dict(plan.phases)

    assert phases["training"].seconds == pytest.approx(1000 * plan.predicted_seconds_per_step, rel=1e-3)
    assert phases["export"].seconds > 0 and phases["export"].host_bytes > 2 * model_size(FLUX_DEV).transformer_params
    assert phases["loading"].gpu_bytes < phases["training"].gpu_bytes == plan.predicted_gpu_bytes


def test_the_planners_adafactor_state_is_what_the_trainers_optimizer_holds_on_the_tiny_model(tiny_base: Path) -> None:
    import torch
    from diffusers import FluxTransformer2DModel

    from fluxbooth.contract.names import OPTIMIZER_HYPERPARAMETERS
    from fluxbooth.train.fused_adafactor import FusedBackwardAdafactor

    transformer = FluxTransformer2DModel.from_pretrained(tiny_base / "transformer", torch_dtype=torch.bfloat16)
    optimizer = FusedBackwardAdafactor(
        transformer.parameters(), lr=1e-5, seed=0, **OPTIMIZER_HYPERPARAMETERS["adafactor"]
    )
    for parameter in transformer.parameters():
        parameter.grad = torch.ones_like(parameter)
        optimizer.step_parameter(parameter)

    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if torch.is_tensor(value) and value.dim()
    )
    assert held == adafactor_state_bytes(model_size(str(tiny_base)))
    assert FusedBackwardAdafactor.__name__ == FUSED_ADAFACTOR_CLASS


# ---- what the worker hands the trainer --------------------------------------------------------------------


def test_a_fused_plan_becomes_a_fused_adafactor_train_json_without_a_deepspeed_config(tmp_path: Path) -> None:
    spec = full_spec()
    plan = plan_for(card(80, 188, "H100 SXM"))

    trainer = trainer_config_for(
        spec, plan, base_model="base", instance_dir=tmp_path / "i", class_dir=None, job_dir=tmp_path
    )
    files = write_launch_files(tmp_path, plan, trainer)

    assert (trainer.memory.fused_backward_pass, trainer.optimisation.optimizer, trainer.training_type) == (
        True,
        "adafactor",
        "full",
    )
    assert trainer.optimisation.learning_rate == FUSED_ADAFACTOR_LEARNING_RATE
    assert files.deepspeed_config is None
    assert "distributed_type: 'NO'" in files.accelerate_config.read_text()


def test_an_explicit_learning_rate_is_kept_under_the_fused_pass(tmp_path: Path) -> None:
    spec = full_spec(learning_rate=2e-6)
    plan = plan_for(card(80, 188, "H100 SXM"), learning_rate=2e-6)

    trainer = trainer_config_for(
        spec, plan, base_model="base", instance_dir=tmp_path / "i", class_dir=None, job_dir=tmp_path
    )

    assert trainer.optimisation.learning_rate == 2e-6


def test_a_deepspeed_plan_keeps_its_optimizer_and_no_fused_pass(tmp_path: Path) -> None:
    spec = full_spec(optimizer="adamw")
    plan = plan_for(card(80, 384, "H100 SXM"), optimizer="adamw")

    trainer = trainer_config_for(
        spec, plan, base_model="base", instance_dir=tmp_path / "i", class_dir=None, job_dir=tmp_path
    )

    assert (trainer.memory.fused_backward_pass, trainer.optimisation.optimizer) == (False, "adamw")
    assert deepspeed_config(plan, trainer)["optimizer"]["type"] == "AdamW"


def test_block_swap_runs_at_the_host_link_nvml_reports_not_at_x16() -> None:
    from dataclasses import replace

    from fluxbooth.plan.gpus import PCIE4_X16
    from fluxbooth.plan.timing import PCIE_EFFICIENCY

    datasheet = card(24, 62, "NVIDIA GeForce RTX 4090")
    in_an_x8_slot = replace(
        datasheet, gpus=tuple(replace(gpu, pcie_generation=4, pcie_width=8) for gpu in datasheet.gpus)
    )
    assert host_link_bytes_per_second(datasheet) == PCIE4_X16 * PCIE_EFFICIENCY
    assert host_link_bytes_per_second(in_an_x8_slot) == PCIE4_X16 / 2 * PCIE_EFFICIENCY
    model, job = model_size(FLUX_DEV), JobShape(training_type="full")
    slow = step_terms(FUSED_SWAP_STRATEGY, model, job, in_an_x8_slot, model.transformer_params, 2)["swapping"]
    assert slow > step_terms(FUSED_SWAP_STRATEGY, model, job, datasheet, model.transformer_params, 2)["swapping"]


def test_a_link_faster_than_the_datasheet_counts_as_the_datasheet() -> None:
    from dataclasses import replace

    from fluxbooth.plan.gpus import PCIE4_X16
    from fluxbooth.plan.timing import PCIE_EFFICIENCY

    datasheet = card(24, 62, "NVIDIA GeForce RTX 4090")
    gen5 = replace(datasheet, gpus=tuple(replace(gpu, pcie_generation=5, pcie_width=16) for gpu in datasheet.gpus))
    assert host_link_bytes_per_second(gen5) == PCIE4_X16 * PCIE_EFFICIENCY
