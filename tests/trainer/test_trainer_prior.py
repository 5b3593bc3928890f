"""Prior preservation, and learning measured at fixed noise.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.fixed_noise_loss import OVERFIT_LOSS_RATIO
from tests.support.trainer_jobs import (
    TrainerRun,
    assert_succeeded,
    load_pipeline,
    make_images,
    make_plan,
    new_job,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# Prior preservation
# --------------------------------------------------------------------------------------------------


def test_prior_preservation_with_supplied_class_images_trains_on_both_sets(tiny_base: Path, tmp_path: Path) -> None:
    job = new_job(
        tmp_path / "job",
        tiny_base,
        with_prior_preservation=True,
        num_class_images=2,
        class_dir=str(tmp_path / "job" / "class"),
    )
    make_images(tmp_path / "job" / "class", 3, seed=5)

    run = job.launch()

    assert_succeeded(run)
    (ready,) = [event for event in run.of_kind("stage") if event.get("status") == "ready"]
    assert (ready["instance_images"], ready["class_images"]) == (3, 2)
    assert not (Path(job.config.cache_dir) / "class_images").exists()


@pytest.fixture(scope="module")
def generated_class_images(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainerRun, Path]:
    root = tmp_path_factory.mktemp("generated-class")
    shared_cache = root / "class-image-cache"
    run = new_job(
        root / "job",
        tiny_base,
        plan=make_plan(training_type="lora"),
        with_prior_preservation=True,
        num_class_images=2,
        class_image_cache_dir=str(shared_cache),
    ).launch()
    assert_succeeded(run)
    return run, shared_cache


def test_prior_preservation_renders_the_missing_class_images_at_the_render_size(
    generated_class_images: tuple[TrainerRun, Path],
) -> None:
    from PIL import Image

    run, shared_cache = generated_class_images
    (recipe_folder,) = shared_cache.iterdir()
    generated = sorted(recipe_folder.glob("*.png"))
    assert [path.name for path in generated] == ["class_00000.png", "class_00001.png"]
    assert Image.open(generated[0]).size == (64, 64)
    (ready,) = [event for event in run.of_kind("stage") if event.get("status") == "ready"]
    assert ready["class_images"] == 2


def test_class_images_are_rendered_by_the_engine_after_it_is_built_and_before_the_first_step(
    generated_class_images: tuple[TrainerRun, Path],
) -> None:
    run, _ = generated_class_images
    order = [
        event.get("what") or event.get("status") or event["event"]
        for event in run.events
        if event["event"] == "step" or event.get("what") in ("engine", "class_images") or event.get("status") == "ready"
    ]
    assert order[:5] == ["engine", "class_images", "class_images", "ready", "step"]
    (announced,) = [event for event in run.of_kind("stage") if event.get("status") == "rendering"]
    # The transformer being trained (its LoRA layers attached), not a second copy of the base.
    assert announced["transformer"]["lora_layers"] > 0


def test_a_class_image_is_what_diffusers_renders_of_the_class_prompt_from_the_base_with_its_seed(
    generated_class_images: tuple[TrainerRun, Path], tiny_base: Path
) -> None:
    import numpy as np
    import torch
    from PIL import Image

    from fluxbooth.train.state import seed_for

    run, shared_cache = generated_class_images
    config = run.config
    (recipe_folder,) = shared_cache.iterdir()
    trained_with = np.asarray(Image.open(recipe_folder / "class_00000.png"), dtype=np.float32) / 255

    def diffusers_render(seed: int) -> np.ndarray:
        return load_pipeline(tiny_base)(
            config.prompts.class_prompt,
            width=64,
            height=64,
            num_inference_steps=config.sampling.class_image_inference_steps,
            guidance_scale=config.sampling.validation_guidance_scale,
            max_sequence_length=config.sampling.max_sequence_length,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        ).images[0]

    own_seed = seed_for(config.optimisation.seed, "class_image", 0)
    same = float(np.abs(diffusers_render(own_seed) - trained_with).mean())
    other = float(np.abs(diffusers_render(own_seed + 1) - trained_with).mean())
    assert same < 0.02 < other, (same, other)


def test_generated_class_images_are_reused_by_the_next_job_with_the_same_recipe(
    generated_class_images: tuple[TrainerRun, Path], tiny_base: Path, tmp_path: Path
) -> None:
    _, shared_cache = generated_class_images
    (recipe_folder,) = shared_cache.iterdir()
    before = {path.name: path.stat().st_mtime_ns for path in recipe_folder.iterdir()}

    run = new_job(
        tmp_path / "job",
        tiny_base,
        plan=make_plan(training_type="lora"),
        with_prior_preservation=True,
        num_class_images=2,
        class_image_cache_dir=str(shared_cache),
    ).launch()

    assert_succeeded(run)
    assert not any(event.get("status") == "generating_class_images" for event in run.of_kind("stage"))
    assert {path.name: path.stat().st_mtime_ns for path in recipe_folder.iterdir()} == before


def test_prior_loss_weight_changes_the_loss(tiny_base: Path, tmp_path: Path) -> None:
    losses = {}
    for weight in (0.0, 1.0):
        job = new_job(
            tmp_path / f"w{weight}",
            tiny_base,
            steps=1,
            with_prior_preservation=True,
            num_class_images=1,
            prior_loss_weight=weight,
            class_dir=str(tmp_path / "class"),
        )
        make_images(tmp_path / "class", 1, seed=9)
        run = job.launch()
        assert_succeeded(run)
        losses[weight] = run.of_kind("step")[0]["loss"]
    assert losses[1.0] > losses[0.0]


# --------------------------------------------------------------------------------------------------
# Learning: over-fitting one image
# --------------------------------------------------------------------------------------------------


def test_overfitting_one_image_lowers_the_fixed_noise_loss_clearly(tiny_base: Path, tmp_path: Path) -> None:
    run = new_job(
        tmp_path / "job", tiny_base, images=1, steps=40, learning_rate=1e-3, measure_fixed_noise_loss=True
    ).launch()

    assert_succeeded(run)
    fixed = run.metrics["fixed_noise_loss"]
    assert fixed["end"] < OVERFIT_LOSS_RATIO * fixed["start"], fixed
    step_losses = [event["loss"] for event in run.of_kind("step")]
    assert sum(step_losses[-10:]) < sum(step_losses[:10])
