"""Plain CLIP fine-tuning: the global contrastive loss only (the baseline every method is compared with)."""
from __future__ import annotations

import torch
from torch import nn

from .common import clip_contrastive_loss


class ClipLoss(nn.Module):
    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        # features: image [B,D], text [B,D] (normalised), logit_scale (exp'd scalar)
        return {"contrastive": clip_contrastive_loss(features["image"], features["text"], features["logit_scale"])}
