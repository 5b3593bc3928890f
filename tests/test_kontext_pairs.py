"""FLUX.1 Kontext's image pairs (issue 20): the zip's `control/` folder holds each training image's input image
(same file stem), refused naming the file when a pair is missing or undecodable; validation control images are
fetched and checked like the dataset; and the control latents reach the transformer as its extra tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fluxbooth.dataset import PreparedDataset, prepare_dataset
from fluxbooth.dataset.controls import fetch_validation_images
from fluxbooth.errors import ErrorCode, FluxboothError
from fluxbooth.request import parse_request
from fluxbooth.settings import DatasetLimits
from fluxbooth.synthetic import build_pipeline, preset
from tests.factories import make_image, make_zip, to_base64

LIMITS = DatasetLimits()
TARGET, CONTROL = (200, 40, 40), (40, 40, 200)


def pair_members(stems: tuple[str, ...] = ("edit0", "edit1", "edit2"), controls: tuple[str, ...] | None = None) -> list[tuple[str, bytes]]:
    members = []
    for stem in stems:
        members.append((f"{stem}.png", make_image("PNG", size=(96, 80), color=TARGET)))
        members.append((f"{stem}.txt", b"make the sky red\n"))
    for stem in stems if controls is None else controls:
        members.append((f"control/{stem}.jpg", make_image("JPEG", size=(96, 80), color=CONTROL)))
    return members


def request(members: list[tuple[str, bytes]], **fields: Any) -> Any:
    raw = {"model_name": "kontext-edit", "dataset": to_base64(make_zip(members)), "instance_prompt": "edit", "resolution": 64}
    return parse_request({**raw, **fields})


def prepare(job_dir: Path, members: list[tuple[str, bytes]]) -> PreparedDataset:
    return prepare_dataset(request(members), job_dir, LIMITS)


def refusal(job_dir: Path, members: list[tuple[str, bytes]]) -> FluxboothError:
    with pytest.raises(FluxboothError) as caught:
        prepare(job_dir, members)
    return caught.value


# ---- the dataset's pairs --------------------------------------------------------------------------------


def test_control_images_are_stored_beside_the_training_images_under_the_same_stems(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", pair_members())
    assert prepared.control_dir is not None and prepared.instance_images == 3 and prepared.control_images == 3
    assert sorted(path.name for path in prepared.control_dir.iterdir()) == ["edit0.png", "edit1.png", "edit2.png"]
    assert sorted(path.name for path in prepared.instance_dir.glob("*.png")) == ["edit0.png", "edit1.png", "edit2.png"]
    assert prepared.summary()["control_images"] == 3


def test_a_dataset_without_a_control_folder_has_no_pairs(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", [member for member in pair_members() if not member[0].startswith("control/")])
    assert (prepared.control_dir, prepared.control_images) == (None, 0)


def test_a_training_image_without_its_control_image_is_refused_naming_it(tmp_path: Path) -> None:
    error = refusal(tmp_path / "job", pair_members(controls=("edit0", "edit2")))
    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == (
        "dataset: 'edit1.png' has no control image: put its input image at control/edit1.<ext> (the same file stem); "
        "with a control/ folder every training image needs one"
    )


def test_a_control_image_without_its_training_image_is_refused_naming_it(tmp_path: Path) -> None:
    error = refusal(tmp_path / "job", pair_members(controls=("edit0", "edit1", "edit2", "orphan")))
    assert error.code is ErrorCode.INVALID_DATASET
    assert error.message == "dataset: 'control/orphan.jpg' has no training image orphan.<ext> at the zip's root; remove it or add its pair"


def test_an_undecodable_control_image_is_refused_naming_it(tmp_path: Path) -> None:
    members = [(name, b"not a jpeg at all" if name == "control/edit1.jpg" else data) for name, data in pair_members()]
    error = refusal(tmp_path / "job", members)
    assert error.code is ErrorCode.INVALID_DATASET
    assert "control/edit1.jpg" in error.message


# ---- validation control images --------------------------------------------------------------------------


def test_validation_control_images_are_stored_for_the_trainer(tmp_path: Path) -> None:
    image = to_base64(make_image("JPEG", size=(120, 90), color=CONTROL))
    stored = fetch_validation_images(
        request(pair_members(), validation_prompts=["make it red"], validation_images=[image]), tmp_path, LIMITS
    )
    assert [path.name for path in stored] == ["00.png"] and stored[0].is_file()


def test_a_validation_image_that_is_not_base64_is_refused_naming_its_field(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        fetch_validation_images(request(pair_members(), validation_prompts=["p"], validation_images=["not*base64"]), tmp_path, LIMITS)
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "input.validation_images[0]: is not valid base64 (Only base64 data is allowed); "
        "send standard base64 of the image, with '=' padding"
    )


def test_a_validation_image_that_is_not_an_image_is_refused_naming_its_field(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        fetch_validation_images(
            request(pair_members(), validation_prompts=["p"], validation_images=[to_base64(b"plain text")]), tmp_path, LIMITS
        )
    assert caught.value.code is ErrorCode.INVALID_DATASET
    assert "input.validation_images[0]" in caught.value.message


def test_more_validation_images_than_prompts_is_refused() -> None:
    with pytest.raises(FluxboothError) as caught:
        request(pair_members(), validation_prompts=["p"], validation_images=["aGk=", "aGk="])
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "invalid request: input.validation_images: 2 control image(s) for 1 validation prompt(s); give at most one per "
        "prompt, in prompt order"
    )


# ---- the objective ---------------------------------------------------------------------------------------


def test_the_control_latents_reach_the_transformer_after_the_targets_tokens(tmp_path: Path) -> None:
    """Kontext's objective (diffusers' train_dreambooth_lora_flux_kontext.py): the clean control latents are
    packed after the noisy target's tokens, with position ids whose first axis is 1, and the loss only sees
    the prediction for the target's tokens."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from fluxbooth.train.family_ops import ops_for
    from fluxbooth.train.flow import SigmaSampler, build_flow_inputs, unpack_prediction
    from tests.trainer_jobs import make_plan, make_trainer_config

    folder = build_pipeline(preset("tiny-kontext"), tmp_path / "tiny-kontext")
    ops = ops_for(str(folder))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    sampler = SigmaSampler.from_scheduler(scheduler, make_trainer_config(tmp_path / "job", folder, make_plan(training_type="lora")))
    transformer = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    seen: list[torch.Tensor] = []
    transformer.x_embedder.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    target, control = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    inputs = build_flow_inputs(
        target, sampler=sampler, generator=torch.Generator().manual_seed(0), guidance_scale=3.5, device=torch.device("cpu"),
        dtype=torch.float32, layout=ops, sigmas=torch.tensor([0.5]), control=control,
    )
    batch = {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 32)}
    with torch.no_grad():
        prediction = transformer(**ops.transformer_inputs(inputs, batch, torch.device("cpu"), torch.float32))[0]
    assert seen[0].shape == (1, 32, 64) and inputs.target_tokens == 16
    assert torch.equal(seen[0][:, 16:], ops.pack(control))
    assert inputs.img_ids[16:, 0].eq(1).all() and inputs.img_ids[:16, 0].eq(0).all()
    assert unpack_prediction(prediction, inputs, ops).shape == target.shape
