"""Every exported safetensors file describes itself: the Stability AI model spec's `modelspec.*` keys and
kohya's `ss_*` training keys, as sd-scripts spells them (all strings), read back with `safetensors` from
files written by the real trainer, which still load in diffusers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from fluxbooth.contract.trainer_config import TrainerConfig
from fluxbooth.models.families import FLUX1, FLUX1_KONTEXT, FLUX2, FLUX2_KLEIN, Family
from fluxbooth.train.export.metadata import FileLayout, TrainingRecord, safetensors_metadata, tag_frequency
from tests.support.trainer_jobs import (
    LORA_FORMATS,
    TrainerRun,
    assert_succeeded,
    base_image,
    lora_pipeline,
    make_plan,
    make_trainer_config,
    new_job,
    render,
)

STARTED_AT = 1_790_000_000.25
FINISHED_AT = 1_790_000_600.5
LORA_LAYOUTS = (FileLayout.LORA_DIFFUSERS, FileLayout.LORA_KOHYA)
FULL_LAYOUTS = (FileLayout.TRANSFORMER_DIFFUSERS, FileLayout.TRANSFORMER_ORIGINAL)


def lora_config(tmp_path: Path, **overrides: object) -> TrainerConfig:
    values: dict[str, object] = {
        "model_name": "my-dog",
        "base_model_name": "black-forest-labs/FLUX.1-dev",
        "trigger_word": "sks",
    }
    return make_trainer_config(tmp_path, tmp_path / "base", make_plan(training_type="lora"), **(values | overrides))


def record_of(config: TrainerConfig, **overrides: object) -> TrainingRecord:
    values: dict[str, object] = {
        "config": config,
        "architecture": "flux-1-dev",
        "base_model_version": "flux1",
        "started_at": STARTED_AT,
        "finished_at": FINISHED_AT,
        "optimizer": "DeepSpeedCPUAdam",
        "total_batch_size": 2,
        "resolution": (512, 768),
        "captions": {"instance": ["sks dog, on grass", "sks dog, Indoors", "sks dog"]},
    }
    return TrainingRecord(**(values | overrides))  # type: ignore[arg-type]


# --- the keys, from a record ---------------------------------------------------------------------


def test_lora_files_are_flux_1_dev_lora_in_their_own_implementation(tmp_path: Path) -> None:
    record = record_of(lora_config(tmp_path))
    described = {layout: safetensors_metadata(record, layout) for layout in LORA_LAYOUTS}
    assert {
        layout: (keys["modelspec.architecture"], keys["modelspec.implementation"]) for layout, keys in described.items()
    } == {
        FileLayout.LORA_DIFFUSERS: ("flux-1-dev/lora", "diffusers"),
        FileLayout.LORA_KOHYA: ("flux-1-dev/lora", "https://github.com/black-forest-labs/flux"),
    }


def test_full_model_files_are_the_base_architecture_without_adapter_suffix(tmp_path: Path) -> None:
    config = make_trainer_config(tmp_path, tmp_path / "base", make_plan(), model_name="my-dog")
    described = {layout: safetensors_metadata(record_of(config), layout) for layout in FULL_LAYOUTS}
    assert {
        layout: (keys["modelspec.architecture"], keys["modelspec.implementation"]) for layout, keys in described.items()
    } == {
        FileLayout.TRANSFORMER_DIFFUSERS: ("flux-1-dev", "diffusers"),
        FileLayout.TRANSFORMER_ORIGINAL: ("flux-1-dev", "https://github.com/black-forest-labs/flux"),
    }


def test_a_flux_1_base_is_schnell_when_its_transformer_embeds_no_guidance() -> None:
    assert FLUX1.modelspec_architecture({"guidance_embeds": False}) == "flux-1-schnell"
    assert FLUX1.modelspec_architecture({"guidance_embeds": True}) == "flux-1-dev"


@pytest.mark.parametrize(
    ("family", "architecture", "version"),
    [
        (FLUX1_KONTEXT, "flux-1-kontext-dev", "flux1"),
        (FLUX2, "flux-2-dev", "flux2"),
        (FLUX2_KLEIN, "flux-2-klein", "flux2"),
    ],
)
def test_each_family_names_its_architecture_and_kohyas_base_model_version(
    family: Family, architecture: str, version: str
) -> None:
    assert (family.modelspec_architecture({}), family.kohya_base_model_version) == (architecture, version)


def test_modelspec_keys_name_the_model_its_resolution_date_and_trigger_phrase(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), FileLayout.LORA_KOHYA)
    assert {
        name: value for name, value in keys.items() if name.startswith("modelspec.") and name != "modelspec.description"
    } == {
        "modelspec.sai_model_spec": "1.0.1",
        "modelspec.architecture": "flux-1-dev/lora",
        "modelspec.implementation": "https://github.com/black-forest-labs/flux",
        "modelspec.title": "my-dog",
        "modelspec.resolution": "512x768",
        "modelspec.date": "2026-09-21T14:23:20+00:00",
        "modelspec.trigger_phrase": "sks",
        "modelspec.usage_hint": "Trigger word: sks",
    }


def test_the_description_says_what_was_trained_and_the_trigger_word(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), FileLayout.LORA_DIFFUSERS)
    assert keys["modelspec.description"] == (
        "FLUX LoRA (rank 4, alpha 8) of black-forest-labs/FLUX.1-dev, trained with fluxbooth: 3 steps at "
        "learning rate 0.001 on 3 images at 512x768. Trigger word: sks."
    )


def test_without_a_trigger_word_there_is_no_trigger_phrase(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path, trigger_word=None)), FileLayout.LORA_KOHYA)
    assert "modelspec.trigger_phrase" not in keys and "modelspec.usage_hint" not in keys


def test_training_keys_are_written_in_kohyas_spelling(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), FileLayout.LORA_KOHYA)
    assert {name: value for name, value in keys.items() if name.startswith("ss_") and name != "ss_tag_frequency"} == {
        "ss_output_name": "my-dog",
        "ss_sd_model_name": "black-forest-labs/FLUX.1-dev",
        "ss_base_model_version": "flux1",
        "ss_training_started_at": "1790000000.25",
        "ss_training_finished_at": "1790000600.5",
        "ss_steps": "3",
        "ss_max_train_steps": "3",
        "ss_learning_rate": "0.001",
        "ss_lr_scheduler": "constant",
        "ss_lr_warmup_steps": "0",
        "ss_optimizer": "DeepSpeedCPUAdam",
        "ss_max_grad_norm": "1.0",
        "ss_batch_size_per_device": "1",
        "ss_total_batch_size": "2",
        "ss_gradient_accumulation_steps": "1",
        "ss_gradient_checkpointing": "True",
        "ss_mixed_precision": "bf16",
        "ss_seed": "7",
        "ss_resolution": "(512, 768)",
        "ss_num_train_images": "3",
        "ss_num_reg_images": "0",
        "ss_prior_loss_weight": "1.0",
        "ss_guidance_scale": "1.0",
        "ss_weighting_scheme": "none",
        "ss_caption_dropout_rate": "0.0",
        "ss_dataset_dirs": '{"instance": {"n_repeats": 1, "img_count": 3}}',
        "ss_enable_bucket": "False",
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": "4",
        "ss_network_alpha": "8.0",
        "ss_network_dropout": "0.0",
        "ss_fp8_base": "False",
    }


def test_tag_frequency_counts_each_comma_separated_tag_per_image_set() -> None:
    captions = {"instance": ["sks dog, on grass", "sks dog, Indoors", "sks dog"], "class": ["a dog", "a dog"]}
    assert tag_frequency(captions) == {"instance": {"sks dog": 3, "on grass": 1, "indoors": 1}, "class": {"a dog": 2}}


def test_the_tag_frequency_key_holds_it_as_json(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), FileLayout.LORA_DIFFUSERS)
    assert json.loads(keys["ss_tag_frequency"]) == {"instance": {"sks dog": 3, "on grass": 1, "indoors": 1}}


def test_class_images_are_counted_as_kohyas_regularisation_images(tmp_path: Path) -> None:
    record = record_of(lora_config(tmp_path), captions={"instance": ["sks dog"], "class": ["a dog", "a dog"]})
    keys = safetensors_metadata(record, FileLayout.LORA_KOHYA)
    assert (keys["ss_num_reg_images"], keys["ss_reg_dataset_dirs"]) == (
        "2",
        '{"class": {"n_repeats": 1, "img_count": 2}}',
    )


def test_only_the_file_in_kohyas_key_layout_names_kohyas_network_module(tmp_path: Path) -> None:
    record = record_of(lora_config(tmp_path))
    assert "ss_network_module" not in safetensors_metadata(record, FileLayout.LORA_DIFFUSERS)
    assert safetensors_metadata(record, FileLayout.LORA_KOHYA)["ss_network_module"] == "networks.lora_flux"


@pytest.mark.parametrize("layout", FULL_LAYOUTS)
def test_full_model_files_carry_no_network_keys(layout: FileLayout, tmp_path: Path) -> None:
    config = make_trainer_config(tmp_path, tmp_path / "base", make_plan(), model_name="my-dog")
    keys = safetensors_metadata(record_of(config), layout)
    assert not [name for name in keys if name.startswith("ss_network_")]
    assert keys["ss_max_train_steps"] == "3"


def test_a_local_base_model_is_named_by_its_folder_only(tmp_path: Path) -> None:
    config = lora_config(tmp_path, base_model_name="/runpod-volume/models/flux-dev")
    assert safetensors_metadata(record_of(config), FileLayout.LORA_KOHYA)["ss_sd_model_name"] == "flux-dev"


def test_aspect_buckets_become_kohyas_bucket_info(tmp_path: Path) -> None:
    record = record_of(lora_config(tmp_path), buckets={"640x384": 1, "512x512": 2})
    keys = safetensors_metadata(record, FileLayout.LORA_KOHYA)
    assert keys["ss_enable_bucket"] == "True"
    assert json.loads(keys["ss_bucket_info"]) == {
        "buckets": {"0": {"resolution": [512, 512], "count": 2}, "1": {"resolution": [640, 384], "count": 1}}
    }


def test_ema_files_say_so_in_their_title(tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), FileLayout.LORA_DIFFUSERS, ema=True)
    assert keys["modelspec.title"] == "my-dog (EMA)"


@pytest.mark.parametrize("layout", [*LORA_LAYOUTS, *FULL_LAYOUTS])
def test_every_value_is_a_string_and_the_format_is_pytorch(layout: FileLayout, tmp_path: Path) -> None:
    keys = safetensors_metadata(record_of(lora_config(tmp_path)), layout)
    assert all(isinstance(value, str) and value for value in keys.values())
    assert keys["format"] == "pt"


# --- the files the trainer wrote ------------------------------------------------------------------


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as opened:
        return dict(opened.metadata())


@pytest.fixture(scope="module")
def lora_run(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    job = new_job(
        tmp_path_factory.mktemp("lora-metadata"),
        tiny_base,
        plan=make_plan(training_type="lora"),
        steps=2,
        export_formats=LORA_FORMATS,
        model_name="my-dog",
        base_model_name="fluxbooth-tiny",
        trigger_word="sks",
    )
    run = job.launch()
    assert_succeeded(run)
    return run


@pytest.fixture(scope="module")
def full_run(tiny_base: Path, tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    # A small shard size splits the tiny transformer over several files: each carries the metadata.
    job = new_job(
        tmp_path_factory.mktemp("full-metadata"),
        tiny_base,
        plan=make_plan(),
        steps=1,
        export_formats=("diffusers", "single_file"),
        max_shard_size="200KB",
        model_name="my-dog",
    )
    run = job.launch()
    assert_succeeded(run)
    return run


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora_diffusers", "lora_comfyui"])
def test_each_exported_lora_file_carries_the_trigger_phrase_and_training_keys(kind: str, lora_run: TrainerRun) -> None:
    metadata = file_metadata(lora_run.artifact(kind))
    assert (metadata["modelspec.architecture"], metadata["modelspec.title"], metadata["modelspec.trigger_phrase"]) == (
        "flux-1-dev/lora",
        "my-dog",
        "sks",
    )
    assert (metadata["ss_network_dim"], metadata["ss_network_alpha"], metadata["ss_max_train_steps"]) == (
        "4",
        "8.0",
        "2",
    )
    assert (metadata["ss_resolution"], metadata["ss_sd_model_name"], metadata["ss_seed"]) == (
        "(64, 64)",
        "fluxbooth-tiny",
        "7",
    )


@pytest.mark.slow
def test_the_exported_files_count_the_tags_of_the_captions_trained_on(lora_run: TrainerRun) -> None:
    # Three generated photos without caption files: each trains with the instance prompt.
    metadata = file_metadata(lora_run.artifact("lora_comfyui"))
    assert json.loads(metadata["ss_tag_frequency"]) == {"instance": {"a photo of sks dog": 3}}


@pytest.mark.slow
def test_the_diffusers_lora_with_its_metadata_still_loads_in_diffusers(lora_run: TrainerRun, tiny_base: Path) -> None:
    pipeline = lora_pipeline(tiny_base, lora_run.artifact("lora_diffusers"))
    (adapter_config,) = pipeline.transformer.peft_config.values()
    assert (adapter_config.r, adapter_config.lora_alpha) == (4, 8.0)
    assert float(abs(render(pipeline) - base_image(tiny_base)).max()) > 1e-4


@pytest.mark.slow
def test_every_shard_of_the_full_model_carries_the_metadata(full_run: TrainerRun) -> None:
    shards = sorted(full_run.artifact("diffusers_transformer").glob("*.safetensors"))
    assert len(shards) > 1
    described = [file_metadata(shard) for shard in shards]
    assert {
        (keys["modelspec.architecture"], keys["modelspec.implementation"], keys["modelspec.title"])
        for keys in described
    } == {("flux-1-dev", "diffusers", "my-dog")}


@pytest.mark.slow
def test_the_sharded_full_model_with_its_metadata_still_loads_in_diffusers(
    full_run: TrainerRun, tiny_base: Path
) -> None:
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(full_run.artifact("diffusers_transformer"))
    assert (
        transformer.config.num_layers
        == FluxTransformer2DModel.load_config(tiny_base, subfolder="transformer")["num_layers"]
    )


@pytest.mark.slow
def test_the_single_file_carries_the_metadata_and_still_reads_as_the_original_layout(full_run: TrainerRun) -> None:
    # diffusers' own single-file reader assumes FLUX.1's full widths (3072), so the tiny model's file is read
    # with safetensors: its header, metadata included, still parses and holds the original key names.
    single_file = full_run.artifact("single_file_transformer")
    metadata = file_metadata(single_file)
    assert (
        metadata["modelspec.architecture"],
        metadata["modelspec.implementation"],
        metadata["ss_max_train_steps"],
    ) == ("flux-1-dev", "https://github.com/black-forest-labs/flux", "1")
    assert "double_blocks.0.img_attn.qkv.weight" in load_file(single_file)
