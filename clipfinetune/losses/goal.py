"""GOAL (Choi et al., CVPR 2025): global + local contrast + Token Similarity based Learning (TSL).

    L_total = lambda_global L_global + lambda_local L_local + lambda_TSL L_TSL                   # eq. (11)

with lambda_global = 1, lambda_local = 0.5, lambda_TSL = 1 (§4.1). lambda_local multiplies the segment-level
CLIP loss L_local, not the TSL terms (docs/methods.md §6.7).

What the paper leaves open, as the authors' code decides it (docs/methods.md §3.2, §6.6) and as we do:

* **L_TSL target (`tsl_target`).** Eq. (14) as written compares an n x n similarity matrix with the identity.
  The authors' code (which produced the published numbers) computes the matrix but uses only its diagonal:
  MSE(diag cos, 1). `tsl_target="diag"` (default) is the code; `"identity"` is eq. (14) as written (MSE of the
  full n x n cosine matrix of the rank's valid rows against the identity; like the authors' B x B matrix it is
  per rank, not gathered).
* **Both sides get gradients.** The targets v_l^cls (crop embedding) and t_l^cls (sentence embedding) are NOT
  detached, as in the authors' code.
* **Pooling (eqs. 7-10)** happens in the model layer: tokens inside the box / sentence span are taken from the
  encoder output BEFORE the final LayerNorm, mean-pooled, then final norm + projection
  (`model.pool_image_hidden` / `model.pool_text_hidden`). The loss receives the pooled embeddings.
  The authors' box-scaling, centre-crop, hard-coded patch-size, span off-by-one and multi-GPU gather-order
  bugs (docs/methods.md §3.4, items 1-5) belong to that glue; here L_global and L_local gather image and text
  separately (`common.gather_features`), which avoids bug 5.
* **Images without a local pair** (LISM found none, or the global image won) train on L_global only: they are
  neither rows nor columns of L_local and take no part in L_TSL (`local_valid` False).
* **Sentences beyond the 248-token truncation** arrive with `span_valid` False: their image-side TSL term is
  kept, their text-side TSL term is dropped (the authors' code instead pools some other tokens, §3.2 "edge
  handling"; we do not copy that).
* **Temperature.** L_global and L_local use the model's learnable logit_scale (the authors' code does not
  clamp it; clamping is the trainer's business).

Features dict expected by `GoalLoss.forward` (B = per-rank batch, D = embed dim; all embeddings normalised):

    image            [B, D]  v_g^cls, global image
    text             [B, D]  t_g^cls, long caption (248-token text encoder)
    logit_scale      []      exp(learnable log-temperature)
    local_image      [B, D]  v_l^cls, embedding of the LISM crop (any finite placeholder where local_valid is False)
    local_text       [B, D]  t_l^cls, embedding of the matched sentence
    local_valid      [B]     bool, the image has a local pair
    region_pooled    [B, D]  P_hat_l: box patches of the global image, pre-norm, mean-pooled, norm + proj
    sentence_pooled  [B, D]  S_hat_l: the sentence's tokens inside the long caption, same recipe
    span_valid       [B]     bool, optional (default all True): the sentence's span survived truncation

Returned terms (already weighted): `contrastive` (L_global), `local_contrastive` (L_local), `tsl_image`,
`tsl_text` (the two halves of L_TSL); their sum is eq. (11). A term whose lambda is 0 is a graph-connected zero
and its inputs are not read (lambda_local = lambda_tsl = 0, GOAL's "global fine-tuning" ablation, needs only
`image`, `text`, `logit_scale`). Counts
are NOT in the returned dict (every value there is a loss); after each call `self.stats` holds them as 0-dim
tensors on the device (never read in the step; tests read them):
`n_local` (rows with a local pair), `n_global_only` (images without one), `n_tsl_text_dropped` (local pairs
whose sentence span was truncated away).
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .common import clip_contrastive_loss, masked_clip_contrastive_loss, masked_mean, weighted_term


def global_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """L_global = L_contrast(v_g^cls, t_g^cls)."""
    return clip_contrastive_loss(image, text, logit_scale)                                      # eq. (12)


def local_loss(local_image: torch.Tensor, local_text: torch.Tensor, logit_scale: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
    """L_local = L_contrast(v_l^cls, t_l^cls) over the images that have a local pair."""
    return masked_clip_contrastive_loss(local_image, local_text, logit_scale, valid)             # eq. (13)


def token_similarity_loss(pooled: torch.Tensor, target: torch.Tensor, valid: torch.Tensor,
                          tsl_target: str = "diag") -> torch.Tensor:
    """One side of L_TSL: MSE(sim(pooled, target), 1) over the valid rows (target not detached).

    `diag`: mean_i (cos(pooled_i, target_i) - 1)^2 (authors' code); `identity`: mean over the n x n cosine
    matrix of the valid rows of (cos_ij - delta_ij)^2 (eq. 14 as written).
    """
    p = F.normalize(pooled, dim=-1)              # invalid rows hold finite placeholders; masked out below
    t = F.normalize(target, dim=-1)
    if tsl_target == "diag":
        return masked_mean(((p * t).sum(dim=-1) - 1).pow(2), valid)          # empty: 0, still in the graph
    sim = p @ t.T
    eye = torch.eye(p.shape[0], dtype=p.dtype, device=p.device)
    return masked_mean((sim - eye).pow(2), valid[:, None] & valid[None, :])  # the valid rows' n x n matrix


class GoalLoss(nn.Module):
    """GOAL's eq. (11); see the module docstring for the features dict and returned terms."""

    def __init__(self, lambda_global: float = 1.0, lambda_local: float = 0.5, lambda_tsl: float = 1.0,
                 tsl_target: Literal["diag", "identity"] = "diag"):
        super().__init__()
        if tsl_target not in ("diag", "identity"):
            raise ValueError(f"tsl_target must be 'diag' or 'identity', got {tsl_target!r}")
        self.lambda_global = lambda_global
        self.lambda_local = lambda_local
        self.lambda_tsl = lambda_tsl
        self.tsl_target = tsl_target
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        f = features
        logit_scale = f["logit_scale"]
        terms = {"contrastive": self.lambda_global * global_loss(f["image"], f["text"], logit_scale)}
        zero = f["image"].sum() * 0.0
        if self.lambda_local == 0 and self.lambda_tsl == 0:               # global-only ablation: no local inputs
            self.stats = {}
            return dict(terms, local_contrastive=zero, tsl_image=zero, tsl_text=zero)
        local_valid = f["local_valid"].bool()
        span_valid = f.get("span_valid")
        text_valid = local_valid & (span_valid.bool() if span_valid is not None else True)
        self.stats = {"n_local": local_valid.sum(), "n_global_only": (~local_valid).sum(),
                      "n_tsl_text_dropped": (local_valid & ~text_valid).sum()}
        terms["local_contrastive"] = weighted_term(self.lambda_local, zero, lambda: local_loss(
            f["local_image"], f["local_text"], logit_scale, local_valid))
        if self.lambda_tsl == 0:
            return dict(terms, tsl_image=zero, tsl_text=zero)
        # L_TSL = MSE(sim(P_hat_l, v_l^cls), 1) + MSE(sim(S_hat_l, t_l^cls), 1)                   # eq. (14)
        terms["tsl_image"] = self.lambda_tsl * token_similarity_loss(
            f["region_pooled"], f["local_image"], local_valid, self.tsl_target)
        terms["tsl_text"] = self.lambda_tsl * token_similarity_loss(
            f["sentence_pooled"], f["local_text"], text_valid, self.tsl_target)
        return terms
