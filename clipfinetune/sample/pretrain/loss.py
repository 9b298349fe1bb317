"""The sample world's pretraining objective (stage `pretrain`): CLIP's contrastive loss plus a region-text term
(float64 reference: tests/reference/pretrain_reference.py).

Not one of the five papers: the objective of the from-scratch base CLIP that stands in for a web-pretrained one
(issue 22). Contrastive training of the pooled embedding alone leaves the dense features that box classification
and the region-level methods read untrained (box top-1 26-46% on 8 shapes while whole-image zero-shot reached
92-94%). RegionCLIP (Zhong et al. 2022) pretrains region-text alignment from region-concept pairs; here the pairs
are the pretraining images' objects and their names, which the world knows:

    L = L_itc + w_rt * L_rt
    L_rt = -1/K sum_k log [ exp(s cos(r_k, t_c(k))) / sum_{c in C} exp(s cos(r_k, t_c)) ]

r_k: the RoIAlign'd dense feature of object k of the batch (`model.region_features`); C: the distinct object names of
the batch ("a red circle"), t_c their text embeddings; c(k): object k's name; s: the model's logit scale. One
direction (region -> names): the names form the batch's classifier, as a detector's region-concept loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clipfinetune.losses.common import clip_contrastive_loss


def region_text_loss(region: torch.Tensor, region_text: torch.Tensor, region_class: torch.Tensor,
                     logit_scale: torch.Tensor) -> torch.Tensor:
    """L_rt: each region against the batch's distinct names (rows of equal `region_class` share one embedding)."""
    classes, target = torch.unique(region_class, return_inverse=True)    # sync: one row per name the batch holds
    rows = torch.arange(len(target), device=target.device)
    # a row per name
    first = torch.zeros(len(classes), dtype=torch.long, device=target.device).scatter_(0, target, rows)
    logits = logit_scale * region @ region_text[first].T
    return F.cross_entropy(logits, target)


class PretrainLoss(nn.Module):
    def __init__(self, region_text_weight: float = 1.0):
        super().__init__()
        self.w_rt = region_text_weight

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        """Reads image, text, logit_scale, and with w_rt > 0 region [K, D], region_text [K, D], region_class [K]."""
        out = {"contrastive": clip_contrastive_loss(features["image"], features["text"], features["logit_scale"])}
        if self.w_rt > 0:
            out["region_text"] = self.w_rt * region_text_loss(
                features["region"], features["region_text"], features["region_class"], features["logit_scale"])
        return out
