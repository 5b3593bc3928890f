"""The tiny FLUX pipeline: complete, FLUX-shaped, offline, deterministic, built atomically."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from fluxbooth.synthetic.tiny import REQUIRED_FILES, build_tiny_pipeline, is_complete_pipeline


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "tiny-flux", seed=0)


def file_digests(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_build_writes_every_pipeline_component(tiny_dir: Path) -> None:
    assert is_complete_pipeline(tiny_dir)
    assert all((tiny_dir / name).is_file() for name in REQUIRED_FILES)


def test_pipeline_is_a_few_hundred_kilobytes(tiny_dir: Path) -> None:
    total = sum(path.stat().st_size for path in tiny_dir.rglob("*") if path.is_file())
    assert total < 3 * 1024 * 1024


def test_pipeline_loads_and_generates_a_64px_image_on_cpu(tiny_dir: Path) -> None:
    import torch
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(tiny_dir)
    pipeline.set_progress_bar_config(disable=True)
    image = pipeline(
        "a photo of sks dog",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    assert image.shape == (64, 64, 3)
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0


def test_components_use_the_flux_classes(tiny_dir: Path) -> None:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(tiny_dir)
    names = {name: type(component).__name__ for name, component in pipeline.components.items() if component is not None}
    assert names == {
        "scheduler": "FlowMatchEulerDiscreteScheduler",
        "vae": "AutoencoderKL",
        "text_encoder": "CLIPTextModel",
        "tokenizer": "CLIPTokenizer",
        "text_encoder_2": "T5EncoderModel",
        "tokenizer_2": names["tokenizer_2"],
        "transformer": "FluxTransformer2DModel",
    }
    assert names["tokenizer_2"] in ("T5TokenizerFast", "T5Tokenizer")  # the same class in transformers 5


def test_transformer_has_flux_dev_guidance_and_consistent_rotary_axes(tiny_dir: Path) -> None:
    from diffusers import FluxTransformer2DModel

    config = FluxTransformer2DModel.load_config(tiny_dir, subfolder="transformer")
    assert config["guidance_embeds"] is True
    assert sum(config["axes_dims_rope"]) == config["attention_head_dim"]
    assert config["in_channels"] == 4 * 16  # 2x2 packing of FLUX's 16 latent channels


def test_64px_images_fit_the_vae_and_packing(tiny_dir: Path) -> None:
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(tiny_dir)
    assert pipeline.vae_scale_factor == 8  # FLUX's own downsampling
    assert 64 % (pipeline.vae_scale_factor * 2) == 0


def test_tokenizers_encode_ascii_prompts_without_unknown_tokens(tiny_dir: Path) -> None:
    from transformers import AutoTokenizer

    clip = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    t5 = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer_2")
    prompt = "A photo of sks dog, 3 years old; on the grass!"
    clip_ids = clip(prompt).input_ids
    t5_ids = t5(prompt).input_ids
    assert clip_ids[0] == clip.bos_token_id and clip_ids[-1] == clip.eos_token_id
    assert clip.unk_token_id not in clip_ids[1:-1]
    assert t5_ids[-1] == t5.eos_token_id
    assert t5.unk_token_id not in t5_ids
    # CLIP lower-cases, and its decoder puts a space before punctuation, as the real CLIP tokenizer does.
    assert clip.decode(clip_ids, skip_special_tokens=True).replace(" ", "") == prompt.lower().replace(" ", "")


def test_same_seed_gives_identical_files(tmp_path: Path, tiny_dir: Path) -> None:
    again = build_tiny_pipeline(tmp_path / "again", seed=0)
    assert file_digests(again) == file_digests(tiny_dir)


def test_different_seed_gives_different_transformer_weights(tmp_path: Path, tiny_dir: Path) -> None:
    other = build_tiny_pipeline(tmp_path / "other", seed=1)
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert file_digests(other)[weights] != file_digests(tiny_dir)[weights]


def test_complete_folder_is_reused_without_rewriting(tiny_dir: Path) -> None:
    before = {path: path.stat().st_mtime_ns for path in tiny_dir.rglob("*") if path.is_file()}
    assert build_tiny_pipeline(tiny_dir, seed=0) == tiny_dir
    assert {path: path.stat().st_mtime_ns for path in tiny_dir.rglob("*") if path.is_file()} == before


def test_incomplete_folder_is_replaced_by_a_complete_one(tmp_path: Path) -> None:
    target = tmp_path / "tiny"
    (target / "transformer").mkdir(parents=True)
    (target / "model_index.json").write_text("{}")
    assert build_tiny_pipeline(target) == target.absolute()
    assert is_complete_pipeline(target)


def test_build_leaves_no_staging_folder_behind(tmp_path: Path) -> None:
    build_tiny_pipeline(tmp_path / "tiny")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["tiny"]


def test_command_line_builds_and_prints_the_folder(tmp_path: Path) -> None:
    target = tmp_path / "cli-tiny"
    completed = subprocess.run(
        [sys.executable, "-m", "fluxbooth.synthetic.tiny", str(target)], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.strip().splitlines()[-1] == str(target.absolute())
    assert is_complete_pipeline(target)
