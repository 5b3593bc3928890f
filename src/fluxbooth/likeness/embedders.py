"""DINOv2 image embeddings (likeness of pets and objects; variety) and SigLIP text-image scores (prompt fidelity),
each loaded from a local folder (fluxbooth.likeness.weights finds it).

- DINOv2: the CLS token after the final layer norm (`pooler_output`), as DreamBooth's DINO metric uses the ViT's
  CLS embedding; compared by cosine.
- SigLIP: the logit, `exp(logit_scale) * cosine(image, text) + logit_bias`, which the model was trained to
  push above 0 for a matching pair; the logit (not its sigmoid, which saturates near 0 and 1) is the one score.
  Texts are padded to the model's maximum length, as SigLIP was trained.
Embeddings stay in memory; nothing here writes or logs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

BATCH_SIZE = 16


def _device() -> Any:
    import torch  # on use only: the worker's process and the CLI's other commands never load it

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _batches(items: Sequence[Any]) -> list[Sequence[Any]]:
    return [items[start : start + BATCH_SIZE] for start in range(0, len(items), BATCH_SIZE)]


@dataclass
class DinoEmbedder:
    model: Any
    processor: Any

    def embed(self, images: Sequence[Image.Image]) -> np.ndarray:
        """One row per image: the CLS embedding."""
        import torch  # on use only: see _device

        rows: list[np.ndarray] = []
        for batch in _batches([image.convert("RGB") for image in images]):
            inputs = self.processor(images=list(batch), return_tensors="pt").to(self.model.device)
            with torch.no_grad():
                rows.append(self.model(**inputs).pooler_output.float().cpu().numpy())
        return np.concatenate(rows) if rows else np.zeros((0, self.model.config.hidden_size))


@dataclass
class SiglipScorer:
    model: Any
    processor: Any

    def logits(self, images: Sequence[Image.Image], texts: Sequence[str]) -> list[float]:
        """The SigLIP logit of each image with its own text (pairs, in order)."""
        import torch  # on use only: see _device

        if len(images) != len(texts):
            raise ValueError(f"{len(images)} images but {len(texts)} texts: each image needs its own text")
        scores: list[float] = []
        for start in range(0, len(images), BATCH_SIZE):
            batch_images = [image.convert("RGB") for image in images[start : start + BATCH_SIZE]]
            batch_texts = list(texts[start : start + BATCH_SIZE])
            inputs = self.processor(
                text=batch_texts, images=batch_images, padding="max_length", truncation=True, return_tensors="pt"
            ).to(self.model.device)
            with torch.no_grad():
                logits = self.model(**inputs).logits_per_image  # images x texts
            scores.extend(float(value) for value in torch.diagonal(logits).float().cpu())
        return scores


def load_dino(folder: Path) -> DinoEmbedder:
    from transformers import AutoImageProcessor, Dinov2Model  # on use only: see _device

    model = Dinov2Model.from_pretrained(str(folder)).to(_device()).eval()
    return DinoEmbedder(model, AutoImageProcessor.from_pretrained(str(folder)))


def load_siglip(folder: Path) -> SiglipScorer:
    from transformers import AutoProcessor, SiglipModel  # on use only: see _device

    model = SiglipModel.from_pretrained(str(folder)).to(_device()).eval()
    return SiglipScorer(model, AutoProcessor.from_pretrained(str(folder)))
