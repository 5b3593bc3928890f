"""The tiny captioner preset: Qwen3-VL's architecture a few dozen wide, built offline, deterministic, once."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from fluxbooth.synthetic.tiny_captioner import VISION_SPECIALS, ensure_tiny_captioner


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("captioner-cache")


@pytest.fixture(scope="module")
def built(cache_dir: Path) -> Path:
    return ensure_tiny_captioner(cache_dir)


def file_digests(folder: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in sorted(folder.iterdir())}


def test_two_builds_of_one_seed_are_identical_file_for_file(built: Path, tmp_path: Path) -> None:
    assert file_digests(ensure_tiny_captioner(tmp_path)) == file_digests(built)


def test_another_seed_gives_other_weights(built: Path, tmp_path: Path) -> None:
    other = ensure_tiny_captioner(tmp_path, seed=1)
    assert file_digests(other)["model.safetensors"] != file_digests(built)["model.safetensors"]


def test_a_second_call_reuses_the_folder(built: Path, cache_dir: Path) -> None:
    written = (built / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_captioner(cache_dir) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(path.name for path in cache_dir.iterdir()) == ["tiny-captioner-seed0"]


def test_the_folder_is_under_a_megabyte(built: Path) -> None:
    assert sum(path.stat().st_size for path in built.iterdir()) < 1024 * 1024


def test_the_model_loads_with_qwen3_vl_class_and_published_patch_geometry(built: Path) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(built)
    vision = model.config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    assert (vision.depth, model.config.text_config.num_hidden_layers) == (2, 2)


def test_the_tokenizer_knows_the_vision_tokens_the_model_names(built: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer, config = AutoTokenizer.from_pretrained(built), AutoConfig.from_pretrained(built)
    ids = dict(zip(VISION_SPECIALS, tokenizer.convert_tokens_to_ids(list(VISION_SPECIALS)), strict=True))
    assert (ids["<|image_pad|>"], ids["<|vision_start|>"], ids["<|vision_end|>"]) == (
        config.image_token_id,
        config.vision_start_token_id,
        config.vision_end_token_id,
    )
    assert max(ids.values()) < config.text_config.vocab_size


def test_the_chat_template_puts_an_image_span_before_the_text(built: Path) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
    text = AutoTokenizer.from_pretrained(built).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe it.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_image_processor_makes_16_pixel_patches_of_a_256_pixel_minimum(built: Path) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(built)(images=[Image.new("RGB", (64, 48))], return_tensors="pt")
    # Under 256x256 pixels: scaled up to 224x320 (multiples of 32, a 2x2 merge of 16-pixel patches), 14x20 patches.
    assert processed["image_grid_thw"].tolist() == [[1, 14, 20]]
