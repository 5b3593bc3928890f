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
from fluxbooth.request.dataset_spec import dataset_spec
from fluxbooth.request.model import parse_request
from fluxbooth.settings import DatasetLimits
from fluxbooth.synthetic import build_pipeline, preset
from tests.support.factories import make_image, make_zip, to_base64

LIMITS = DatasetLimits()
TARGET, CONTROL = (200, 40, 40), (40, 40, 200)


def pair_members(
    stems: tuple[str, ...] = ("edit0", "edit1", "edit2"), controls: tuple[str, ...] | None = None
) -> list[tuple[str, bytes]]:
    members = []
    for stem in stems:
        members.append((f"{stem}.png", make_image("PNG", size=(96, 80), color=TARGET)))
        members.append((f"{stem}.txt", b"make the sky red\n"))
    for stem in stems if controls is None else controls:
        members.append((f"control/{stem}.jpg", make_image("JPEG", size=(96, 80), color=CONTROL)))
    return members


def request(members: list[tuple[str, bytes]], **fields: Any) -> Any:
    raw = {
        "model_name": "kontext-edit",
        "dataset": to_base64(make_zip(members)),
        "instance_prompt": "edit",
        "resolution": 64,
    }
    return parse_request({**raw, **fields})


def prepare(job_dir: Path, members: list[tuple[str, bytes]]) -> PreparedDataset:
    return prepare_dataset(dataset_spec(request(members)), job_dir, LIMITS)


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
    assert (
        error.message
        == "dataset: 'control/orphan.jpg' has no training image orphan.<ext> at the zip's root; remove it or add its pair"
    )


def test_an_undecodable_control_image_is_refused_naming_it(tmp_path: Path) -> None:
    members = [(name, b"not a jpeg at all" if name == "control/edit1.jpg" else data) for name, data in pair_members()]
    error = refusal(tmp_path / "job", members)
    assert error.code is ErrorCode.INVALID_DATASET
    assert "control/edit1.jpg" in error.message


# ---- one pairing rule for the dataset stage and the trainer (issue 29, items 2, 3, 7) ----------------------


def trainer_pairs(prepared: PreparedDataset) -> dict[str, str]:
    """The trainer's pairing of the stored files: each training image's name → its control image's name."""
    from fluxbooth.train.data import discover_images, with_controls

    assert prepared.control_dir is not None
    paired = with_controls(discover_images(prepared.instance_dir, "edit"), prepared.control_dir)
    return {image.path.name: image.control.name for image in paired if image.control is not None}


def test_pairs_told_apart_only_by_case_are_paired_by_the_dataset_stage_and_the_trainer_alike(tmp_path: Path) -> None:
    members = [(f"Photo{index}.png", make_image("PNG", size=(96, 80), color=TARGET)) for index in range(3)] + [
        (f"control/photo{index}.JPG", make_image("JPEG", size=(96, 80), color=CONTROL)) for index in range(3)
    ]
    prepared = prepare(tmp_path / "job", members)
    assert trainer_pairs(prepared) == {f"Photo{index}.png": f"Photo{index}.png" for index in range(3)}


def test_the_trainer_pairs_stored_files_told_apart_only_by_case(tmp_path: Path) -> None:
    from fluxbooth.train.data import TrainingImage, with_controls

    (tmp_path / "instance").mkdir()
    (tmp_path / "control").mkdir()
    (tmp_path / "instance" / "Photo0.png").write_bytes(make_image("PNG", size=(8, 8)))
    (tmp_path / "control" / "photo0.png").write_bytes(make_image("PNG", size=(8, 8)))
    paired = with_controls([TrainingImage(tmp_path / "instance" / "Photo0.png", "edit")], tmp_path / "control")
    assert paired[0].control == tmp_path / "control" / "photo0.png"


def test_non_ascii_stems_are_paired_on_their_own_characters(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "job", pair_members(stems=("猫", "犬", "写真1")))
    assert sorted(path.name for path in prepared.instance_dir.glob("*.png")) == ["写真1.png", "犬.png", "猫.png"]
    assert trainer_pairs(prepared) == {"写真1.png": "写真1.png", "犬.png": "犬.png", "猫.png": "猫.png"}


def test_non_ascii_stems_that_differ_are_not_a_pair(tmp_path: Path) -> None:
    members = pair_members(stems=("写真1", "edit1", "edit2"), controls=("画像1", "edit1", "edit2"))
    error = refusal(tmp_path / "job", members)
    assert (error.code, error.message) == (
        ErrorCode.INVALID_DATASET,
        "dataset: '写真1.png' has no control image: put its input image at control/写真1.<ext> (the same file stem); "
        "with a control/ folder every training image needs one",
    )


def test_stems_in_composed_and_decomposed_unicode_are_one_pair(tmp_path: Path) -> None:
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    prepared = prepare(
        tmp_path / "job", pair_members(stems=(decomposed, "edit1", "edit2"), controls=(composed, "edit1", "edit2"))
    )
    assert trainer_pairs(prepared)["café.png"] == "café.png"


def test_two_training_images_one_case_apart_are_refused_naming_both_uploads(tmp_path: Path) -> None:
    error = refusal(tmp_path / "job", pair_members(stems=("Edit0", "edit0", "edit1")))
    assert (error.code, error.message) == (
        ErrorCode.INVALID_DATASET,
        "dataset: 'edit0.png' and 'Edit0.png' share the file stem 'edit0' (stems are compared ignoring case); image "
        "pairs are matched by file stem, so give each pair a stem of its own",
    )


def test_image_pairs_with_prior_preservation_are_invalid_input_before_any_image_is_decoded(tmp_path: Path) -> None:
    members = pair_members() + [(f"class/dog{index}.png", b"never decoded") for index in range(3)]
    with pytest.raises(FluxboothError) as caught:
        prepare_dataset(
            dataset_spec(request(members, with_prior_preservation=True, class_prompt="a photo")),
            tmp_path / "job",
            LIMITS,
        )
    assert (caught.value.code, caught.value.message) == (
        ErrorCode.INVALID_INPUT,
        "input.with_prior_preservation: the zip has a control/ folder (image pairs), and image-pair training has no "
        "class images with control images; turn with_prior_preservation off, or remove the control/ folder",
    )


# ---- validation control images --------------------------------------------------------------------------


def test_validation_control_images_are_stored_for_the_trainer(tmp_path: Path) -> None:
    image = to_base64(make_image("JPEG", size=(120, 90), color=CONTROL))
    stored = fetch_validation_images(
        dataset_spec(request(pair_members(), validation_prompts=["make it red"], validation_images=[image])),
        tmp_path,
        LIMITS,
    )
    assert [path.name for path in stored] == ["00.png"] and stored[0].is_file()


def test_a_validation_image_that_is_not_base64_is_refused_naming_its_field(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        fetch_validation_images(
            dataset_spec(request(pair_members(), validation_prompts=["p"], validation_images=["abc"])),
            tmp_path,
            LIMITS,
        )
    assert caught.value.code is ErrorCode.INVALID_INPUT
    assert caught.value.message == (
        "input.validation_images[0]: is not valid base64 (Incorrect padding); "
        "send standard base64 of the image, with '=' padding"
    )


def test_a_validation_image_that_is_not_an_image_is_refused_naming_its_field(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        fetch_validation_images(
            dataset_spec(
                request(pair_members(), validation_prompts=["p"], validation_images=[to_base64(b"plain text")])
            ),
            tmp_path,
            LIMITS,
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

    from fluxbooth.train.base_model import ops_for
    from fluxbooth.train.flow import SigmaSampler, build_flow_inputs, unpack_prediction
    from tests.support.trainer_jobs import make_plan, make_trainer_config

    folder = build_pipeline(preset("tiny-kontext"), tmp_path / "tiny-kontext")
    ops = ops_for(str(folder))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(folder, subfolder="scheduler")
    sampler = SigmaSampler.from_scheduler(
        scheduler, make_trainer_config(tmp_path / "job", folder, make_plan(training_type="lora"))
    )
    transformer = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    seen: list[torch.Tensor] = []
    transformer.x_embedder.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    target, control = torch.randn(1, 16, 8, 8), torch.randn(1, 16, 8, 8)
    inputs = build_flow_inputs(
        target,
        sampler=sampler,
        generator=torch.Generator().manual_seed(0),
        guidance_scale=3.5,
        device=torch.device("cpu"),
        dtype=torch.float32,
        layout=ops,
        sigmas=torch.tensor([0.5]),
        control=control,
    )
    batch = {"prompt_embeds": torch.randn(1, 8, 32), "pooled_prompt_embeds": torch.randn(1, 32)}
    with torch.no_grad():
        prediction = transformer(**ops.transformer_inputs(inputs, batch, torch.device("cpu"), torch.float32))[0]
    assert seen[0].shape == (1, 32, 64) and inputs.target_tokens == 16
    assert torch.equal(seen[0][:, 16:], ops.pack(control))
    assert inputs.img_ids[16:, 0].eq(1).all() and inputs.img_ids[:16, 0].eq(0).all()
    assert unpack_prediction(prediction, inputs, ops).shape == target.shape


# ---- validation_images loose ends (issue 29, item 10) -----------------------------------------------------


def test_an_ftp_validation_image_is_refused_as_a_url(tmp_path: Path) -> None:
    with pytest.raises(FluxboothError) as caught:
        fetch_validation_images(
            dataset_spec(
                request(pair_members(), validation_prompts=["p"], validation_images=["ftp://example.com/a.png"])
            ),
            tmp_path,
            LIMITS,
        )
    assert (caught.value.code, caught.value.message) == (
        # Refused when the request is read, before anything is fetched.
        ErrorCode.INVALID_INPUT,
        "invalid request: input.validation_images: [0] only http:// and https:// URLs are accepted",
    )


def test_an_upper_case_http_validation_image_is_downloaded_as_a_url(tmp_path: Path) -> None:
    from tests.support.http_fixtures import LocalHTTPServer

    with LocalHTTPServer() as server:
        url = server.add("/c.png", body=make_image("PNG", size=(96, 80), color=CONTROL)).replace("http://", "HTTP://")
        stored = fetch_validation_images(
            dataset_spec(request(pair_members(), validation_prompts=["p"], validation_images=[url])),
            tmp_path,
            DatasetLimits(allow_private_urls=True),
        )
    assert [path.name for path in stored] == ["00.png"]


@pytest.mark.parametrize("family_name", ["flux1", "flux2", "flux2-klein"])
def test_validation_images_for_a_family_that_does_not_use_them_are_refused_before_fetching(family_name: str) -> None:
    from fluxbooth.dataset.controls import check_validation_images_used
    from fluxbooth.models.families import family_named

    family = family_named(family_name)
    with pytest.raises(FluxboothError) as caught:
        check_validation_images_used(
            dataset_spec(
                request(pair_members(), validation_prompts=["p"], validation_images=["https://example.com/a.png"])
            ),
            family,
        )
    assert (caught.value.code, caught.value.message) == (
        ErrorCode.INVALID_INPUT,
        f"input.validation_images: {family.title} renders validation prompts from text alone and does not use control "
        "images (FLUX.1 Kontext does); remove validation_images",
    )


def test_validation_images_for_kontext_pass_the_family_check() -> None:
    from fluxbooth.dataset.controls import check_validation_images_used
    from fluxbooth.models.families import FLUX1_KONTEXT

    kontext_job = dataset_spec(
        request(pair_members(), validation_prompts=["p"], validation_images=["https://example.com/a.png"])
    )
    assert check_validation_images_used(kontext_job, FLUX1_KONTEXT) is None
