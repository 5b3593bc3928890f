"""EMA and validation images, at the end and during training.

The real trainer on the tiny FLUX model under the real `accelerate launch` (tests/support/trainer_jobs.py);
each module-scoped fixture is one training run, the tests read what it produced."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fluxbooth.request.spec import model_sampling
from fluxbooth.sizing import model_size
from tests.support.trainer_jobs import (
    LORA_FORMATS,
    TrainerRun,
    assert_succeeded,
    lora_pipeline,
    make_images,
    make_plan,
    new_job,
    read_json,
    render,
    transformer_state,
)

pytestmark = pytest.mark.slow


# --------------------------------------------------------------------------------------------------
# EMA and validation images
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_with_ema_and_validation(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    plan = make_plan(training_type="lora")
    job = new_job(
        tmp_path_factory.mktemp("ema"),
        tiny_base,
        plan=plan,
        steps=3,
        ema_decay=0.5,
        validation_prompts=("a photo of sks dog", "a sks dog in the snow"),
        export_formats=LORA_FORMATS,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def test_ema_lora_is_exported_beside_the_trained_lora_in_every_format(lora_with_ema_and_validation: TrainerRun) -> None:
    ema = load_file(lora_with_ema_and_validation.artifact("ema_lora_diffusers"))
    trained = load_file(lora_with_ema_and_validation.artifact("lora_diffusers"))
    assert ema.keys() == trained.keys()
    assert lora_with_ema_and_validation.artifact("ema_lora_comfyui").is_file()


def test_ema_lora_averages_towards_the_start(lora_with_ema_and_validation: TrainerRun) -> None:
    # LoRA B starts at zero, so an average over the run is smaller than where the run ended.
    ema = load_file(lora_with_ema_and_validation.artifact("ema_lora_diffusers"))
    trained = load_file(lora_with_ema_and_validation.artifact("lora_diffusers"))
    b_keys = [key for key in trained if key.endswith("lora_B.weight")]
    ema_norm = sum(float(ema[key].float().norm()) for key in b_keys)
    trained_norm = sum(float(trained[key].float().norm()) for key in b_keys)
    assert 0 < ema_norm < trained_norm


def test_ema_lora_loads_in_diffusers(lora_with_ema_and_validation: TrainerRun, tiny_base: Path) -> None:
    image = render(lora_pipeline(tiny_base, lora_with_ema_and_validation.artifact("ema_lora_diffusers")))
    assert image.shape == (64, 64, 3)


def test_validation_images_are_rendered_for_each_prompt_with_their_seed(
    lora_with_ema_and_validation: TrainerRun,
) -> None:
    from PIL import Image

    index = read_json(lora_with_ema_and_validation.artifact("validation_index"))
    assert [record["prompt"] for record in index["images"]] == ["a photo of sks dog", "a sks dog in the snow"]
    assert all(isinstance(record["seed"], int) for record in index["images"])
    images = [entry for entry in lora_with_ema_and_validation.done["artifacts"] if entry["kind"] == "validation_image"]
    assert [Path(entry["path"]).name for entry in images] == [record["file"] for record in index["images"]]
    for entry in images:
        with Image.open(lora_with_ema_and_validation.output_dir / entry["path"]) as image:
            assert (image.format, image.size) == ("PNG", (64, 64))


def test_full_zero3_with_ema_exports_an_ema_transformer(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    run = new_job(tmp_path / "job", tiny_base, plan=plan, steps=2, ema_decay=0.5).launch()

    assert_succeeded(run)
    ema, trained = (
        transformer_state(run.artifact("ema_diffusers_transformer")),
        transformer_state(run.artifact("diffusers_transformer")),
    )
    assert ema.keys() == trained.keys()
    assert any(not torch.equal(ema[name], trained[name]) for name in trained)


VALIDATION_PROMPTS = ("a photo of sks dog", "a sks dog in the snow")


def validation_job(root: Path, tiny_base: Path, plan: Any, **overrides: Any) -> Any:
    settings = {"steps": 5, "validation_prompts": VALIDATION_PROMPTS, "export_formats": ("diffusers",), **overrides}
    return new_job(root, tiny_base, plan=plan, **settings)


def validation_pixels(run: TrainerRun, file: str) -> Any:
    import numpy
    from PIL import Image

    with Image.open(run.output_dir / "validation" / file) as image:
        assert (image.format, image.size) == ("PNG", (64, 64))
        return numpy.asarray(image, dtype=numpy.int16)


def records_at(run: TrainerRun, training_step: int) -> list[dict[str, Any]]:
    index = read_json(run.artifact("validation_index"))
    return [record for record in index["images"] if record["training_step"] == training_step]


@pytest.fixture(scope="module")
def lora_validation_every_2(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = validation_job(
        tmp_path_factory.mktemp("validation-steps"), tiny_base, make_plan(training_type="lora"), validation_steps=2
    ).launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def lora_4_steps_without_validation_steps(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    run = validation_job(
        tmp_path_factory.mktemp("validation-end"), tiny_base, make_plan(training_type="lora"), steps=4
    ).launch()
    assert_succeeded(run)
    return run


def test_validation_steps_render_every_prompt_at_every_nth_step_and_at_the_end(
    lora_validation_every_2: TrainerRun,
) -> None:
    index = read_json(lora_validation_every_2.artifact("validation_index"))
    assert [(record["training_step"], record["prompt"], record["file"]) for record in index["images"]] == [
        (2, VALIDATION_PROMPTS[0], "step-000002/validation_00.png"),
        (2, VALIDATION_PROMPTS[1], "step-000002/validation_01.png"),
        (4, VALIDATION_PROMPTS[0], "step-000004/validation_00.png"),
        (4, VALIDATION_PROMPTS[1], "step-000004/validation_01.png"),
        (5, VALIDATION_PROMPTS[0], "validation_00.png"),
        (5, VALIDATION_PROMPTS[1], "validation_01.png"),
    ]
    for record in index["images"]:
        validation_pixels(lora_validation_every_2, record["file"])


def test_validation_images_of_every_step_are_uploadable_artifacts_with_unique_names(
    lora_validation_every_2: TrainerRun,
) -> None:
    images = [entry for entry in lora_validation_every_2.done["artifacts"] if entry["kind"] == "validation_image"]
    index = read_json(lora_validation_every_2.artifact("validation_index"))
    assert [entry["path"] for entry in images] == [f"validation/{record['file']}" for record in index["images"]]
    assert [entry["name"] for entry in images] == [
        "validation_step000002_00",
        "validation_step000002_01",
        "validation_step000004_00",
        "validation_step000004_01",
        "validation_00",
        "validation_01",
    ]


def test_validation_images_keep_one_seed_per_prompt_across_steps(lora_validation_every_2: TrainerRun) -> None:
    seeds = [[record["seed"] for record in records_at(lora_validation_every_2, step)] for step in (2, 4, 5)]
    assert seeds[0] == seeds[1] == seeds[2]
    assert len(set(seeds[0])) == 2


def test_validation_images_change_as_training_goes_on(lora_validation_every_2: TrainerRun) -> None:
    early = validation_pixels(lora_validation_every_2, "step-000002/validation_00.png")
    later = validation_pixels(lora_validation_every_2, "step-000004/validation_00.png")
    final = validation_pixels(lora_validation_every_2, "validation_00.png")
    # The tiny model renders near-grey noise; a few steps of LoRA move many pixels by a level or two.
    assert (early != final).mean() > 0.1
    assert (early != later).mean() > 0.1


def test_validation_during_training_is_a_validate_stage_between_steps(lora_validation_every_2: TrainerRun) -> None:
    sequence = [
        (event["event"], event.get("step"))
        for event in lora_validation_every_2.events
        if event["event"] == "step"
        # A validate stage opens once per render; its "rendering" follow-up reports what is resident.
        or (event["event"] == "stage" and event["stage"] == "validate" and event.get("status") != "rendering")
    ]
    assert sequence == [
        ("step", 1),
        ("step", 2),
        ("stage", 2),
        ("step", 3),
        ("step", 4),
        ("stage", 4),
        ("step", 5),
        ("stage", None),
    ]


def test_validation_during_training_leaves_the_training_itself_unchanged(
    lora_validation_every_2: TrainerRun, lora_4_steps_without_validation_steps: TrainerRun
) -> None:
    with_renders = [event["loss"] for event in lora_validation_every_2.of_kind("step")]
    without = [event["loss"] for event in lora_4_steps_without_validation_steps.of_kind("step")]
    assert with_renders[:4] == without


def test_validation_during_training_renders_what_the_final_round_of_a_run_that_long_renders(
    lora_validation_every_2: TrainerRun, lora_4_steps_without_validation_steps: TrainerRun
) -> None:
    # The same first 4 steps: the round at step 4 of a longer run and the final round of a 4-step run.
    during = validation_pixels(lora_validation_every_2, "step-000004/validation_01.png")
    final = validation_pixels(lora_4_steps_without_validation_steps, "validation_01.png")
    earlier = validation_pixels(lora_validation_every_2, "step-000002/validation_01.png")
    assert (during != final).mean() < 0.01  # measured: pixel-identical on the CPU
    assert (earlier != final).mean() > 0.1


def test_full_zero3_renders_validation_images_during_training(tiny_base: Path, tmp_path: Path) -> None:
    plan = make_plan(zero_stage=3, offload_param="cpu")
    run = validation_job(tmp_path / "job", tiny_base, plan, validation_steps=2).launch()

    assert_succeeded(run)
    assert [record["training_step"] for record in read_json(run.artifact("validation_index"))["images"]] == [
        2,
        2,
        4,
        4,
        5,
        5,
    ]
    early, final = validation_pixels(run, "step-000002/validation_00.png"), validation_pixels(run, "validation_00.png")
    assert (early != final).mean() > 0.1


def rendering_residencies(run: TrainerRun) -> list[dict[str, Any]]:
    """What the transformer held at each validation round, as the trainer reported it before rendering."""
    return [
        event["transformer"]
        for event in run.events
        if event["event"] == "stage" and event["stage"] == "validate" and event.get("status") == "rendering"
    ]


def test_the_final_round_renders_through_zero3s_shards_as_the_rounds_during_training_do(
    tiny_base: Path, tmp_path: Path
) -> None:
    # Every parameter partitioned (no persistence threshold): a render that reloaded the weights would hold the
    # whole transformer, as diffusers' model offload puts it whole on one GPU.
    job = validation_job(
        tmp_path / "job",
        tiny_base,
        make_plan(training_type="lora", zero_stage=3, offload_param="cpu"),
        steps=3,
        validation_steps=2,
    )
    files = job.write()
    ds_config = read_json(files.deepspeed_config)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    files.deepspeed_config.write_text(json.dumps(ds_config))
    job.write = lambda: files  # type: ignore[method-assign]  # launch the patched files as they are
    run = job.launch()

    assert_succeeded(run)
    during, final = rendering_residencies(run)[0], rendering_residencies(run)[-1]
    whole = (tiny_base / "transformer" / "diffusion_pytorch_model.safetensors").stat().st_size
    assert final == during and sum(final["stored_bytes_by_dtype"].values()) < whole / 10


@pytest.mark.parametrize(
    ("training_type", "settings"),
    [("lora", {"optimizer": "adamw"}), ("full", {"fused_backward_pass": True, "optimizer": "adafactor"})],
    ids=["lora", "fused_full"],
)
def test_without_deepspeed_validation_renders_during_training(
    tiny_base: Path, tmp_path: Path, training_type: str, settings: dict[str, Any]
) -> None:
    # accelerate's own mixed precision returns the model's outputs in fp32: the VAE must decode fp32 latents.
    plan = make_plan(training_type=training_type, use_deepspeed=False, zero_stage=0, offload_optimizer="none")
    run = validation_job(tmp_path / "job", tiny_base, plan, steps=2, validation_steps=1, **settings).launch()

    assert_succeeded(run)
    assert [record["training_step"] for record in read_json(run.artifact("validation_index"))["images"]] == [1, 1, 2, 2]


def test_two_processes_lora_under_zero3_render_validation_images_during_training(
    tiny_base: Path, tmp_path: Path
) -> None:
    # Every rank runs the forward (each holds a slice of every layer); only the main process writes.
    plan = make_plan(training_type="lora", zero_stage=3, offload_param="cpu", num_processes=2)
    run = validation_job(tmp_path / "job", tiny_base, plan, steps=3, validation_steps=2).launch()

    assert_succeeded(run)
    assert [record["training_step"] for record in read_json(run.artifact("validation_index"))["images"]] == [2, 2, 3, 3]
    early, final = validation_pixels(run, "step-000002/validation_00.png"), validation_pixels(run, "validation_00.png")
    assert (early != final).mean() > 0.1


# --------------------------------------------------------------------------------------------------
# A schnell-like base (no guidance embedding), LoRA exported for ComfyUI only, prior preservation with
# supplied class images and validation prompts: one run, read by the tests below.
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schnell_like_base(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline as FLUX.1-schnell is built: `guidance_embeds` false, no guidance embedder weights."""
    base = tmp_path_factory.mktemp("schnell") / "tiny-schnell"
    shutil.copytree(tiny_base, base)
    config_path = base / "transformer" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "guidance_embeds": False}))
    weights_path = base / "transformer" / "diffusion_pytorch_model.safetensors"
    save_file(
        {name: tensor for name, tensor in load_file(weights_path).items() if "guidance_embedder" not in name},
        weights_path,
    )
    return base


@pytest.fixture(scope="module")
def schnell_comfyui_lora(schnell_like_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    root = tmp_path_factory.mktemp("schnell-comfyui")
    make_images(root / "class", 2, seed=5)
    sampling = model_sampling(model_size(str(schnell_like_base)))
    job = new_job(
        root / "job",
        schnell_like_base,
        plan=make_plan(training_type="lora"),
        steps=2,
        export_formats=("comfyui",),
        with_prior_preservation=True,
        class_dir=str(root / "class"),
        validation_prompts=("a sks dog in the snow",),
        # As the job spec resolves them for this model.
        max_sequence_length=sampling.max_sequence_length,
        validation_inference_steps=sampling.inference_steps,
        validation_guidance_scale=sampling.guidance_scale,
    )
    run = job.launch()
    assert_succeeded(run)
    return run


def test_lora_exported_only_for_comfyui_renders_its_validation_images_from_the_comfyui_file(
    schnell_comfyui_lora: TrainerRun,
) -> None:
    kinds = [artifact["kind"] for artifact in schnell_comfyui_lora.done["artifacts"]]
    assert "lora_diffusers" not in kinds
    assert schnell_comfyui_lora.artifact("lora_comfyui").is_file()
    assert schnell_comfyui_lora.artifact("validation_image").is_file()


def test_text_encoders_load_once_for_the_instance_class_and_validation_prompts(
    schnell_comfyui_lora: TrainerRun,
) -> None:
    assert sorted(schnell_comfyui_lora.metrics["released_before_training"]) == ["text_encoder", "text_encoder_2", "vae"]
    cache = Path(schnell_comfyui_lora.config.cache_dir)
    assert [len(list(cache.glob(f"{name}-*.pt"))) for name in ("instance", "class", "validation")] == [1, 1, 1]


def test_a_model_without_guidance_embedding_is_sampled_with_schnell_defaults(schnell_comfyui_lora: TrainerRun) -> None:
    index = read_json(schnell_comfyui_lora.output_dir / "validation" / "validation.json")
    assert (index["guidance_scale"], [record["steps"] for record in index["images"]]) == (0.0, [4])
    (instance_cache,) = Path(schnell_comfyui_lora.config.cache_dir).glob("instance-*.pt")
    assert torch.load(instance_cache, weights_only=True)["prompt_embeds"].shape[1] == 256
