"""The `pretrain` stage's method: plain CLIP plus the region-text term (`sample/pretrain/loss.py`), sample world only.

Not a fine-tuning run (clipfinetune/registry.py lists those): `CaptionPairSource` with a region key serves the
batches, whose `region_boxes` / `region_text` / `region_class` name every object of the batch's images.
"""
from __future__ import annotations

import torch
from torch import nn

from clipfinetune.methods.clip import ClipFeatures, ClipMethod


class PretrainFeatures(ClipFeatures):
    def forward(self, batch: dict) -> dict:
        if "region_boxes" not in batch:
            return super().forward(batch)
        image = self.model.image_features(batch["image"], dense=True)   # one forward: embedding and dense map
        # the count of distinct names sizes the text batch (each name encoded once, once in the loss's denominator)
        # sync: one read a step, in the sample world's pretraining only
        names, inverse = torch.unique(batch["region_text"], dim=0, return_inverse=True)
        return {"image": image["global_"],
                "text": self.model.encode_text(batch["text"], normalize=True),
                "logit_scale": self.model.clip.logit_scale.exp(),
                "region": self.model.pool_regions(image["dense"], batch["region_boxes"]),
                "region_text": self.model.encode_text(names, normalize=True)[inverse],
                "region_class": batch["region_class"]}


class PretrainMethod(ClipMethod):
    name = "pretrain"

    def __init__(self, region_text_weight: float = 1.0):
        super().__init__()
        self.region_text_weight = region_text_weight

    def build(self, model) -> nn.Module:
        return PretrainFeatures(model)

    def loss(self) -> nn.Module:
        from clipfinetune.sample.pretrain.loss import PretrainLoss

        return PretrainLoss(self.region_text_weight)
