"""Inputs for the likeness tests, built at test time: public-domain portraits that ship inside PyPI packages
(scikit-image's astronaut, Eileen Collins; matplotlib's Grace Hopper) under realistic changes, a trainer-like
validation folder, and tiny randomly initialised DINOv2 and SigLIP folders written by save_pretrained."""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


def astronaut() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.astronaut())


def grace_hopper() -> Image.Image:
    import matplotlib.cbook

    return Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)).convert("RGB")


def cat() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.chelsea())


def coffee() -> Image.Image:
    from skimage import data

    return Image.fromarray(data.coffee())


def _crop_and_scale(image: Image.Image) -> Image.Image:
    width, height = image.size
    return image.crop((width // 8, height // 10, width - width // 8, height - height // 20)).resize(
        (int(width * 0.6), int(height * 0.6))
    )


def _rotate(image: Image.Image) -> Image.Image:
    return image.rotate(8, resample=Image.Resampling.BICUBIC, fillcolor=(128, 128, 128))


def _colour_shift(image: Image.Image) -> Image.Image:
    shifted = np.asarray(image).astype(float) * [1.1, 0.95, 0.85]
    return Image.fromarray(shifted.clip(0, 255).astype(np.uint8))


def _jpeg(image: Image.Image) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=30)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _new_background(image: Image.Image) -> Image.Image:
    width, height = image.size
    canvas = Image.new("RGB", (width + 200, height + 100), (30, 120, 60))
    canvas.paste(image.crop((width // 6, 0, width - width // 6, height)), (150, 60))
    return canvas


# Each realistic change a photo or a render of the same person may show.
CHANGES: dict[str, Callable[[Image.Image], Image.Image]] = {
    "original": lambda image: image.copy(),
    "crop_and_scale": _crop_and_scale,
    "rotation": _rotate,
    "colour_shift": _colour_shift,
    "jpeg": _jpeg,
    "flip": ImageOps.mirror,
    "new_background": _new_background,
}


def views(image: Image.Image, names: Sequence[str] = tuple(CHANGES)) -> dict[str, Image.Image]:
    return {name: CHANGES[name](image) for name in names}


def save_all(images: Sequence[Image.Image], folder: Path, stem: str = "image") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for number, image in enumerate(images):
        path = folder / f"{stem}_{number:02d}.png"
        image.save(path)
        paths.append(path)
    return paths


def write_validation(
    validation_dir: Path, renders_by_step: dict[int, Sequence[Image.Image]], prompts: Sequence[str]
) -> None:
    """A folder laid out as the trainer writes it: step-NNNNNN/validation_NN.png indexed in validation.json."""
    records = []
    for step, renders in sorted(renders_by_step.items()):
        folder = validation_dir / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        for index, render in enumerate(renders):
            render.save(folder / f"validation_{index:02d}.png")
            records.append(
                {
                    "file": f"step-{step:06d}/validation_{index:02d}.png",
                    "prompt": prompts[index],
                    "seed": 1000 + index,
                    "steps": 4,
                    "training_step": step,
                }
            )
    (validation_dir / "validation.json").write_text(json.dumps({"images": records, "guidance_scale": 3.5}))


def offline_environ(root: Path) -> dict[str, str]:
    """An environment where no scoring model is cached and nothing may be downloaded."""
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(root / "hf-home"),
        "FLUXBOOTH_RUNPOD_MODEL_CACHE": str(root / "runpod-cache"),
        "FLUXBOOTH_BAKED_MODELS_DIR": str(root / "baked"),
        "HOME": str(root),
    }


def tiny_dino(folder: Path) -> Path:
    """A randomly initialised DINOv2 (2 layers, 32 wide, 28 px) with its image processor."""
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=28, patch_size=14
    )
    Dinov2Model(config).save_pretrained(folder)
    BitImageProcessor(
        size={"shortest_edge": 28},
        crop_size={"height": 28, "width": 28},
        do_center_crop=True,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(folder)
    return folder


def tiny_siglip(folder: Path) -> Path:
    """A randomly initialised SigLIP (2 layers each side, 32 wide, 32 px) with a 27-piece sentencepiece tokenizer."""
    import sentencepiece
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipProcessor, SiglipTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder.parent / f"{folder.name}-corpus.txt"
    corpus.write_text("\n".join(["a photo of a dog on the beach", "a person in a red coat", "a mug on a table"] * 50))
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(folder / "spiece"),
        vocab_size=27,
        model_type="unigram",
        hard_vocab_limit=False,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        minloglevel=2,
    )
    tokenizer = SiglipTokenizer(vocab_file=str(folder / "spiece.model"), model_max_length=16)
    SiglipProcessor(
        image_processor=SiglipImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer
    ).save_pretrained(folder)
    text = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 1,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 16,
    }
    SiglipModel(SiglipConfig(text_config=text, vision_config=vision)).save_pretrained(folder)
    return folder
