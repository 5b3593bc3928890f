"""What the trainer makes for likeness scoring: the validation prompts rendered by the base model before the first
step (step 0, the same seeds as every later round), also after a resume, and with keep_best_step the LoRA of every
validation step in each requested format.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py): one run that
checkpoints at step 2, and one resumed from that checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from fluxbooth.contract.scoring import STEP_LORAS_FOLDER
from tests.support.trainer_jobs import (
    LORA_FORMATS,
    TrainerRun,
    assert_succeeded,
    lora_pipeline,
    make_plan,
    new_job,
    read_json,
    render,
)

pytestmark = pytest.mark.slow

PROMPTS = ("a photo of sks dog", "a sks dog in the snow")
SETTINGS: dict[str, Any] = {
    "steps": 5,
    "validation_prompts": PROMPTS,
    "validation_steps": 2,
    "validation_at_start": True,
    "checkpointing_steps": 2,
    "export_formats": LORA_FORMATS,
}


@pytest.fixture(scope="module")
def runs(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, TrainerRun]:
    """(the run from step 0, the same run resumed from its step-2 checkpoint)."""
    root, plan = tmp_path_factory.mktemp("likeness"), make_plan(training_type="lora")
    first = new_job(
        root / "first",
        tiny_base,
        plan=plan,
        step_loras_dir=str(root / "first" / "output" / STEP_LORAS_FOLDER),
        **SETTINGS,
    ).launch()
    assert_succeeded(first)
    checkpoint = next(event["path"] for event in first.of_kind("checkpoint") if event["step"] == 2)
    resumed = new_job(root / "resumed", tiny_base, plan=plan, resume_from=checkpoint, **SETTINGS).launch()
    assert_succeeded(resumed)
    return first, resumed


def pixels(run: TrainerRun, file: str) -> Any:
    with Image.open(run.output_dir / "validation" / file) as image:
        return numpy.asarray(image, dtype=numpy.int16)


def step_lora(run: TrainerRun, step: int, name: str = "pytorch_lora_weights.safetensors") -> Path:
    return run.output_dir / STEP_LORAS_FOLDER / f"step-{step:06d}" / "lora" / name


def test_the_base_model_renders_every_prompt_before_the_first_step_with_the_seeds_of_every_round(
    runs: tuple[TrainerRun, TrainerRun],
) -> None:
    index = read_json(runs[0].artifact("validation_index"))["images"]
    assert [(record["training_step"], record["file"]) for record in index] == [
        (0, "step-000000/validation_00.png"),
        (0, "step-000000/validation_01.png"),
        (2, "step-000002/validation_00.png"),
        (2, "step-000002/validation_01.png"),
        (4, "step-000004/validation_00.png"),
        (4, "step-000004/validation_01.png"),
        (5, "validation_00.png"),
        (5, "validation_01.png"),
    ]
    seeds = {step: [record["seed"] for record in index if record["training_step"] == step] for step in (0, 2, 4, 5)}
    assert seeds[0] == seeds[2] == seeds[4] == seeds[5]


def test_the_step_0_renders_change_once_training_has_moved_the_lora(runs: tuple[TrainerRun, TrainerRun]) -> None:
    assert (
        pixels(runs[0], "step-000000/validation_00.png") != pixels(runs[0], "step-000002/validation_00.png")
    ).mean() > 0.1


def test_a_resumed_lora_run_renders_step_0_with_its_adapters_off_as_the_first_run_did(
    runs: tuple[TrainerRun, TrainerRun],
) -> None:
    first, resumed = runs
    assert [record["training_step"] for record in read_json(resumed.artifact("validation_index"))["images"]] == [
        0,
        0,
        4,
        4,
        5,
        5,
    ]
    for file in ("step-000000/validation_00.png", "step-000000/validation_01.png"):
        assert (pixels(first, file) != pixels(resumed, file)).mean() < 0.01  # measured: pixel-identical on the CPU


def test_keep_best_step_saves_the_lora_of_every_validation_step_in_each_format(
    runs: tuple[TrainerRun, TrainerRun],
) -> None:
    first = runs[0]
    saved = sorted(
        path.relative_to(first.output_dir / STEP_LORAS_FOLDER).as_posix()
        for path in (first.output_dir / STEP_LORAS_FOLDER).rglob("*.safetensors")
    )
    assert saved == [
        "step-000002/lora/lora_comfyui.safetensors",
        "step-000002/lora/pytorch_lora_weights.safetensors",
        "step-000004/lora/lora_comfyui.safetensors",
        "step-000004/lora/pytorch_lora_weights.safetensors",
    ]
    assert not (runs[1].output_dir / STEP_LORAS_FOLDER).exists()


def test_a_validation_steps_lora_holds_the_weights_of_that_step(runs: tuple[TrainerRun, TrainerRun]) -> None:
    first = runs[0]
    two, four, final = (
        load_file(path) for path in (step_lora(first, 2), step_lora(first, 4), first.artifact("lora_diffusers"))
    )
    assert two.keys() == four.keys() == final.keys()
    b_keys = [key for key in final if key.endswith("lora_B.weight")]
    assert any(not numpy.array_equal(two[key].float().numpy(), four[key].float().numpy()) for key in b_keys)
    assert any(not numpy.array_equal(four[key].float().numpy(), final[key].float().numpy()) for key in b_keys)
    with safe_open(str(step_lora(first, 4)), "pt") as handle:
        assert handle.metadata()["ss_steps"] == "4"


def test_a_validation_steps_lora_loads_in_diffusers(runs: tuple[TrainerRun, TrainerRun], tiny_base: Path) -> None:
    assert render(lora_pipeline(tiny_base, step_lora(runs[0], 2))).shape == (64, 64, 3)
