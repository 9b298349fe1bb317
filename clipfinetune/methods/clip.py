"""Plain CLIP fine-tuning: the baseline every method is compared with (and the `pretrain` objective).

Data: each shard image with ONE of its short captions, drawn by the loader's per-example `rng` (a new draw every
epoch, as COCO fine-tuning in open_clip-style loaders). Records without short captions (DOCCI-only images) are
skipped. Loss: the symmetric in-batch InfoNCE (`losses.clip.ClipLoss`), gathered across ranks.
"""
from __future__ import annotations

import random
from typing import ClassVar

from torch import nn

from .base import CaptionUnits, Method


class ClipFeatures(nn.Module):
    """forward(batch) -> image/text embeddings (normalised) and the learnable logit scale, exp'd."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> dict:
        return {"image": self.model.encode_image(batch["image"], normalize=True),
                "text": self.model.encode_text(batch["text"], normalize=True),
                "logit_scale": self.model.clip.logit_scale.exp()}


class ClipMethod(CaptionUnits, Method):
    name = "clip"
    terms: ClassVar[dict[str, str | None]] = {"contrastive": None}

    def __init__(self):
        super().__init__()

    def wants(self, record: dict) -> bool:
        return bool(record.get("captions"))

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        caption = rng.choice(record["captions"])
        return {"image": ctx.transform(image), "text": ctx.tokenize([caption])[0]}

    def build(self, model) -> nn.Module:
        return ClipFeatures(model)

    def loss(self) -> nn.Module:
        from clipfinetune.losses.clip import ClipLoss

        return ClipLoss()
