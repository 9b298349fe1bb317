"""DeGLA (ACM MM 2025): hard-negative-aware global contrast + self-distillation + local (IGC, TGC) contrast.

    L_all = L_base + lambda_1 L_IGC + lambda_2 L_TGC + lambda_3 L_Distill                     # eq. (10)

with (lambda_1, lambda_2, lambda_3) = (lambda_igc, lambda_tgc, lambda_distill) = (0.1, 0.1, 0.005).

Features dict (``forward(features)``); B = local batch, K = negatives per caption (4 in the paper), D = joint dim.
All embeddings are L2-normalised (the model's ``global_`` outputs):

    image             [B, D]      student image embedding v_i
    text              [B, D]      student positive-caption embedding t_i
    neg_text          [B, K, D]   student negative-caption embeddings t-bar_{i,k} (any value where invalid)
    neg_valid         [B, K] bool optional (default: all valid); True where sample i has negative k
    logit_scale       scalar      the model's exp(learnable log-temperature) = 1/tau (L_base, L_IGC)
    teacher_image     [B, D]      EMA teacher v*_i
    teacher_text      [B, D]      EMA teacher t*_i
    teacher_neg_text  [B, K, D]   EMA teacher t-bar*_{i,k}

Teacher features are detached here (defensively; the EMA update lives in the model layer). Returned terms
(already weighted): ``contrastive`` (L_base), ``igc``, ``tgc``, ``distill``.

What this module decides that the paper leaves open (authors' code: xiaoxing2001/DeGLA@1c5e960
``src/open_clip/loss.py`` ``CLIPloss_DeGLA`` — docs/methods.md §4.3, §6.11-6.13):
- L_base (eq. 4-5): image->text over all gathered positives plus EVERY sample's K negatives as extra columns
  (eq. 4 as printed sums t-bar_{i,k} inside sum_j; its own text, "t-bar_{j,k} denotes the k-th negative of the
  j-th text", and the code use all samples' negatives, NegCLIP style); text->image over positives only. Columns
  are gathered across ranks with ``common.gather_features`` (differentiable), rows are local.
- L_IGC (eq. 8): per image, its positive against its own K negatives with the model's learnable logit scale
  (the code masks the same N x (N + NK) logits down to these 1+K columns; we build the 1+K logits directly).
- L_TGC (eq. 9): anchor = student t_i; candidates = teacher t*_i and the sample's own K student negatives;
  logits = ``tgc_logit_scale`` * cos (10 in the code, i.e. tau = 0.1, fixed). The authors' code masks with
  ``mask_0.repeat(1, K)``, which assumes a negative-type-major layout while its data are sample-major, so each
  row mostly contrasts OTHER samples' negatives (docs/methods.md §4.3). That is a bug; we implement the paper's intent:
  the sample's own negatives.
- L_Distill (eq. 7): squared L2 between student and teacher normalised embeddings of images, positives and
  (valid) negatives, SUMMED over the batch (eq. 7 and the code's ``reduction='sum'``). Per-sample, so it stays
  local: the local sum is multiplied by the world size so that, after DDP's gradient averaging, the gradient is
  that of the sum over the global batch (one process on the concatenated batch; the code's gathered sum,
  which backpropagates only into the local shard, is 1/world of that, as are all its terms).
- Missing negatives (the paper always has K = 4; our LLM stage may produce fewer): -inf in every softmax, never
  a zero vector, and left out of the distillation sum. In L_IGC and L_TGC a row without any valid negative is a
  1-way softmax (loss 0); such rows are dropped from the mean (as FSC-CLIP's HN losses), and if no row has a
  negative the term is an exact 0 that stays in the graph.
- Means: L_base averages over the local rows (open_clip ``local_loss``); L_IGC and L_TGC over the local rows
  with a negative. With DDP averaging, each equals one process on the concatenated batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import contrastive_labels, gather_features, masked_cross_entropy, weighted_term, world


def hard_negative_contrastive_loss(image, text, neg_text, neg_valid, logit_scale) -> torch.Tensor:
    """L_base (eq. 4-5): (L_I->T with every sample's negatives as extra columns + L_T->I over positives) / 2."""
    b, k, d = neg_text.shape
    all_image, all_text, all_neg, all_valid = gather_features(
        image, text, neg_text.reshape(b * k, d), neg_valid.reshape(b * k).to(image.dtype))
    labels = contrastive_labels(b, image.device)
    columns = torch.cat([all_text, all_neg], dim=0)                                   # [N + NK, D]
    logits_i2t = logit_scale * image @ columns.T
    column_valid = torch.cat([torch.ones_like(all_text[:, 0], dtype=torch.bool), all_valid > 0.5])
    logits_i2t = logits_i2t.masked_fill(~column_valid, float("-inf"))                 # missing negatives
    loss_i2t = F.cross_entropy(logits_i2t, labels)                                    # eq. (4)
    loss_t2i = F.cross_entropy(logit_scale * text @ all_image.T, labels)              # eq. (2)
    return (loss_i2t + loss_t2i) / 2                                                  # eq. (5)


def own_negative_choice_loss(anchor, positive, neg_text, neg_valid, scale) -> torch.Tensor:
    """-log softmax_0 of scale * anchor_i . [positive_i, t-bar_{i,1..K}] over valid candidates, mean over rows
    with a valid negative (the shared form of eq. 8 and eq. 9)."""
    keep = neg_valid.any(dim=1)
    pos = torch.einsum("bd,bd->b", anchor, positive).unsqueeze(1)
    neg = torch.einsum("bd,bkd->bk", anchor, neg_text)
    valid = torch.cat([torch.ones_like(neg_valid[:, :1]), neg_valid], dim=1)
    # mask after scaling: scale * (-inf) would give the scale a NaN gradient (0 * -inf)
    logits = (scale * torch.cat([pos, neg], dim=1)).masked_fill(~valid, float("-inf"))   # [B, 1+K]
    target = torch.zeros_like(keep, dtype=torch.long)                                      # the positive, column 0
    return masked_cross_entropy(logits, target, keep)             # no row with a negative: 0, in the graph


def image_grounded_contrast_loss(image, text, neg_text, neg_valid, logit_scale) -> torch.Tensor:
    """L_IGC (eq. 8): image v_i against its positive t_i and its own negatives t-bar_{i,k}."""
    return own_negative_choice_loss(image, text, neg_text, neg_valid, logit_scale)


def text_grounded_contrast_loss(text, teacher_text, neg_text, neg_valid, tgc_logit_scale) -> torch.Tensor:
    """L_TGC (eq. 9): student t_i against the teacher's t*_i and its OWN negatives t-bar_{i,k}.

    Paper's intent, not the released mask (which selects other samples' negatives, docs/methods.md §4.3/§6.11).
    """
    return own_negative_choice_loss(text, teacher_text.detach(), neg_text, neg_valid, tgc_logit_scale)


def self_distillation_loss(image, text, neg_text, teacher_image, teacher_text, teacher_neg_text,
                           neg_valid) -> torch.Tensor:
    """L_Distill (eq. 7): sum_i ||v_i - v*_i||^2 + ||t_i - t*_i||^2 + sum_k ||t-bar_{i,k} - t-bar*_{i,k}||^2."""
    image_term = (image - teacher_image.detach()).pow(2).sum()
    text_term = (text - teacher_text.detach()).pow(2).sum()
    neg_sq = (neg_text - teacher_neg_text.detach()).pow(2).sum(dim=-1)               # [B, K]
    neg_term = torch.where(neg_valid, neg_sq, torch.zeros_like(neg_sq)).sum()        # missing: excluded
    _, world_size = world()
    return (image_term + text_term + neg_term) * world_size          # DDP-average -> sum over the global batch


class DeglaLoss(nn.Module):
    """DeGLA's objective (eq. 10) as named, weighted terms: contrastive, igc, tgc, distill."""

    def __init__(self, lambda_igc: float = 0.1, lambda_tgc: float = 0.1, lambda_distill: float = 0.005,
                 tgc_logit_scale: float = 10.0):
        super().__init__()
        self.lambda_igc, self.lambda_tgc = float(lambda_igc), float(lambda_tgc)
        self.lambda_distill, self.tgc_logit_scale = float(lambda_distill), float(tgc_logit_scale)

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        f = features
        image, text, neg_text, scale = f["image"], f["text"], f["neg_text"], f["logit_scale"]
        neg_valid = f.get("neg_valid")
        neg_valid = (torch.ones(neg_text.shape[:2], dtype=torch.bool, device=neg_text.device)
                     if neg_valid is None else neg_valid.bool())
        terms = {"contrastive": hard_negative_contrastive_loss(image, text, neg_text, neg_valid, scale)}
        zero = image.sum() * 0.0
        terms["igc"] = weighted_term(self.lambda_igc, zero, lambda: image_grounded_contrast_loss(
            image, text, neg_text, neg_valid, scale))                                 # eq. (10)
        terms["tgc"] = weighted_term(self.lambda_tgc, zero, lambda: text_grounded_contrast_loss(
            text, f["teacher_text"], neg_text, neg_valid, self.tgc_logit_scale))      # eq. (10)
        terms["distill"] = weighted_term(self.lambda_distill, zero, lambda: self_distillation_loss(
            image, text, neg_text, f["teacher_image"], f["teacher_text"], f["teacher_neg_text"], neg_valid))
        return terms
