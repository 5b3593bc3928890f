"""Synthetic FLUX pipelines: exact full-size architectures, sharded writing, diffusers-loadable folders."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fluxbooth.synthetic import build_pipeline, count_parameters, preset

SMALL_SHARD = "40MB"


def run_cli(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fluxbooth.synthetic", *arguments], capture_output=True, text=True, timeout=600
    )


def file_digests(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def scaled_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scaled preset written in 40 MB shards: its ~140 MB transformer spans several files."""
    target = tmp_path_factory.mktemp("synthetic") / "scaled"
    completed = run_cli("--preset", "scaled", "--max-shard-size", SMALL_SHARD, str(target))
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().splitlines()[-1] == str(target.absolute())
    return target


def test_count_of_flux1_dev_is_the_published_size_of_every_component() -> None:
    completed = run_cli("--preset", "flux1-dev", "--count")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads(completed.stdout) == {
        "transformer": 11_901_408_320,
        "text_encoder_2": 4_762_310_656,
        "text_encoder": 123_060_480,
        "vae": 83_819_683,
    }


def test_flux1_schnell_differs_from_dev_only_by_the_guidance_embedding() -> None:
    dev, schnell = count_parameters(preset("flux1-dev")), count_parameters(preset("flux1-schnell"))
    # The guidance embedder: Linear(256 -> 3072) and Linear(3072 -> 3072), with biases.
    assert dev["transformer"] - schnell["transformer"] == (256 * 3072 + 3072) + (3072 * 3072 + 3072)
    assert {name: count for name, count in dev.items() if name != "transformer"} == {
        name: count for name, count in schnell.items() if name != "transformer"
    }
    assert preset("flux1-schnell").scheduler["use_dynamic_shifting"] is False


def test_full_presets_agree_with_the_planners_model_sizes() -> None:
    from fluxbooth.sizing import FLUX_DEV_NAME, model_size

    counts = count_parameters(preset("flux1-dev"))
    size = model_size(FLUX_DEV_NAME)
    assert size.transformer_params == counts["transformer"]


def test_layers_override_changes_only_the_transformer_depth() -> None:
    full = preset("flux1-dev")
    reduced = full.with_layers(2, 4)
    assert reduced.transformer == {**full.transformer, "num_layers": 2, "num_single_layers": 4}
    assert (reduced.text_encoder_2, reduced.vae, reduced.scheduler) == (full.text_encoder_2, full.vae, full.scheduler)


def test_layers_override_without_any_block_is_refused() -> None:
    completed = run_cli("--preset", "flux1-dev", "--count", "--layers", "0,0")
    assert completed.returncode == 2
    assert "--layers 0,0: needs at least one block and no negative counts" in completed.stderr


def test_unknown_preset_is_refused_with_the_choices() -> None:
    completed = run_cli("--preset", "flux2", "--count")
    assert completed.returncode == 2
    assert "invalid choice: 'flux2'" in completed.stderr and "flux1-dev" in completed.stderr


def test_scaled_transformer_is_the_benchs_70m_model(scaled_dir: Path) -> None:
    config = json.loads((scaled_dir / "transformer" / "config.json").read_text())
    assert (config["num_layers"], config["num_single_layers"], config["num_attention_heads"]) == (4, 8, 4)
    assert config["attention_head_dim"] == 128 and sum(config["axes_dims_rope"]) == 128
    assert count_parameters(preset("scaled"))["transformer"] == 70_992_960


def test_shard_index_maps_every_tensor_to_a_file_that_holds_it(scaled_dir: Path) -> None:
    from safetensors import safe_open

    folder = scaled_dir / "transformer"
    index = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    assert files == [
        f"diffusion_pytorch_model-{n:05d}-of-{len(files):05d}.safetensors" for n in range(1, len(files) + 1)
    ]
    total = 0
    for file_name in files:
        with safe_open(str(folder / file_name), framework="pt") as handle:
            names = set(handle.keys())
            assert names == {name for name, owner in index["weight_map"].items() if owner == file_name}
            total += sum(handle.get_tensor(name).nbytes for name in names)
    assert index["metadata"]["total_size"] == total


def test_every_shard_stays_within_the_size_limit(scaled_dir: Path) -> None:
    sizes = [path.stat().st_size for path in (scaled_dir / "transformer").glob("*-of-*.safetensors")]
    # The header (tensor names and offsets) comes on top of the limit on tensor bytes.
    assert max(sizes) <= 40 * 1000**2 + 64 * 1024


def test_transformer_loads_with_diffusers_and_holds_the_written_weights(scaled_dir: Path) -> None:
    import torch
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file

    transformer, info = FluxTransformer2DModel.from_pretrained(
        scaled_dir, subfolder="transformer", output_loading_info=True
    )
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    written = load_file(scaled_dir / "transformer" / "diffusion_pytorch_model-00002-of-00004.safetensors")
    state = transformer.state_dict()
    assert all(torch.equal(tensor.float(), state[name].float()) for name, tensor in written.items())
    assert all(tensor.dtype == torch.bfloat16 for tensor in written.values())


def test_weights_are_random_not_empty(scaled_dir: Path) -> None:
    from safetensors.torch import load_file

    written = load_file(scaled_dir / "transformer" / "diffusion_pytorch_model-00001-of-00004.safetensors")
    linear = [tensor.float() for name, tensor in written.items() if name.endswith(".weight") and tensor.ndim == 2]
    assert linear and all(0.0 < float(tensor.std()) < 1.0 for tensor in linear)


def test_pipeline_loads_with_flux_pipeline_and_renders(scaled_dir: Path) -> None:
    import torch
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(scaled_dir, torch_dtype=torch.bfloat16)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(
        "a photo of sks dog",
        height=64,
        width=64,
        num_inference_steps=1,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert image.shape == (64, 64, 3)


def test_same_seed_gives_identical_files_and_another_seed_other_weights(tmp_path: Path) -> None:
    reduced = preset("tiny").with_layers(1, 1).with_max_shard_bytes(20_000)
    first = file_digests(build_pipeline(reduced, tmp_path / "a", seed=3))
    again = file_digests(build_pipeline(reduced, tmp_path / "b", seed=3))
    other = file_digests(build_pipeline(reduced, tmp_path / "c", seed=4))
    assert first == again
    shards = [name for name in first if name.startswith("transformer/diffusion_pytorch_model-00001-of-")]
    assert len(shards) == 1 and first[shards[0]] != other[shards[0]]


def test_sharded_t5_encoder_loads_without_missing_weights(tmp_path: Path) -> None:
    from transformers import T5EncoderModel

    folder = build_pipeline(preset("tiny").with_max_shard_bytes(20_000), tmp_path / "tiny-sharded")
    assert (folder / "text_encoder_2" / "model.safetensors.index.json").is_file()
    encoder, info = T5EncoderModel.from_pretrained(folder, subfolder="text_encoder_2", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert encoder.encoder.embed_tokens.weight is encoder.shared.weight


def test_complete_folder_is_reused_without_rewriting(tmp_path: Path) -> None:
    reduced = preset("tiny").with_layers(1, 1)
    folder = build_pipeline(reduced, tmp_path / "p")
    before = {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()}
    assert build_pipeline(reduced, folder) == folder
    assert {path: path.stat().st_mtime_ns for path in folder.rglob("*") if path.is_file()} == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["p"]


def test_full_size_tokenizers_have_the_real_vocabulary_sizes_and_special_ids() -> None:
    from fluxbooth.synthetic.vocab import full_size_tokenizers

    tokenizers = full_size_tokenizers()
    clip, t5 = tokenizers["tokenizer"], tokenizers["tokenizer_2"]
    assert len(clip) == 49408 and len(t5) == 32100
    assert (clip.bos_token_id, clip.eos_token_id, clip.pad_token_id) == (49406, 49407, 49407)
    assert (t5.pad_token_id, t5.eos_token_id, t5.unk_token_id) == (0, 1, 2)
    prompt = "A photo of sks dog, 3 years old; on the grass!"
    clip_ids = clip(prompt, padding="max_length", max_length=77).input_ids
    t5_ids = t5(prompt, padding="max_length", max_length=512).input_ids
    assert len(clip_ids) == 77 and len(t5_ids) == 512
    assert clip.unk_token_id not in clip(prompt).input_ids[1:-1] and t5.unk_token_id not in t5_ids


def test_full_size_shards_have_the_sizes_of_flux1_devs_published_files() -> None:
    import torch

    from fluxbooth.synthetic.build import component_configs, construct, plan_shards, unique_state_names

    full = preset("flux1-dev")
    configs = component_configs(full)
    sizes = {}
    for component in ("transformer", "text_encoder_2"):
        model = construct(component, configs[component], "meta", torch.bfloat16)
        shards = plan_shards(model, unique_state_names(model), full.max_shard_bytes[component], torch.bfloat16)
        sizes[component] = [round(shard.nbytes / 1e9, 2) for shard in shards]
    assert sizes == {"transformer": [9.98, 9.95, 3.87], "text_encoder_2": [4.99, 4.53]}


def test_tiny_preset_is_fluxbooth_tinys_pipeline(tmp_path: Path) -> None:
    from fluxbooth.synthetic.tiny import build_tiny_pipeline

    completed = run_cli("--preset", "tiny", str(tmp_path / "via-synthetic"))
    assert completed.returncode == 0, completed.stderr[-3000:]
    direct = build_tiny_pipeline(tmp_path / "via-tiny")
    assert file_digests(tmp_path / "via-synthetic") == file_digests(direct)


def test_reduced_depth_variant_writes_only_its_transformer_and_links_the_rest(tmp_path: Path) -> None:
    from diffusers import FluxPipeline

    base = build_pipeline(preset("tiny").with_layers(1, 1), tmp_path / "base")
    completed = run_cli(
        "--preset", "tiny", "--layers", "2,2", "--share-encoders-with", str(base), str(tmp_path / "deeper")
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    deeper = tmp_path / "deeper"
    assert all(
        (deeper / name).is_symlink() for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "scheduler")
    )
    assert not (deeper / "transformer").is_symlink()
    pipeline = FluxPipeline.from_pretrained(deeper)
    assert (pipeline.transformer.config.num_layers, pipeline.transformer.config.num_single_layers) == (2, 2)


def test_sharing_with_a_folder_that_is_not_a_pipeline_is_refused(tmp_path: Path) -> None:
    completed = run_cli(
        "--preset", "tiny", "--layers", "1,1", "--share-encoders-with", str(tmp_path), str(tmp_path / "x")
    )
    assert completed.returncode == 2
    assert f"--share-encoders-with {tmp_path}: not a complete pipeline folder (missing ['vae'," in completed.stderr


def test_a_killed_builders_staging_folder_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    import os

    from fluxbooth.synthetic.staging import remove_abandoned_staging

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / f".model.building-{finished.stdout.strip()}-0123abcd"
    live = tmp_path / f".model.building-{os.getpid()}-4567ef01"
    for folder in (dead, live):
        (folder / "transformer").mkdir(parents=True)
    assert remove_abandoned_staging(tmp_path / "model") == [dead]
    assert not dead.exists() and live.is_dir()
