"""FSC-CLIP (Oh et al., EMNLP 2024): CLIP loss + global HN loss + local HN (LHN) loss, both HN losses under SCR.

    L_total = L_clip + lambda_g * L^g_neg + lambda_l * L^l_neg                                  # eq. (11)

Features dict (``forward(features)``); B = local batch, K = negatives per caption (3: negclip, replace,
bi-gram shuffle, in that order), D = joint dim, P = patches, L = text context length:

    image       [B, D]          global image embedding, L2-normalised (``image_features()["global_"]``)
    text        [B, D]          global positive-caption embedding, L2-normalised
    neg_text    [B, K, D]       global negative-caption embeddings, L2-normalised (any value where invalid)
    neg_valid   [B, K] bool     True where the generator produced negative k of sample i
    patches     [B, P, D]       projected patch tokens after ln_post, NOT normalised (``image_features()["patches"]``)
    text_tokens [B, 1+K, L, D]  projected text token states, NOT normalised; [:, 0] = positive, [:, 1+k] = negative k
    text_mask   [B, 1+K, L] bool  keeps EOT (and the final period), drops SOT and padding (``text_features()["mask"]``)
    logit_scale scalar          exp(learnable log-temperature) = 1/tau

``patches``/``text_tokens``/``text_mask`` are read only when ``lambda_l != 0``; ``neg_text`` only when
``lambda_g != 0``.
Returned terms (already weighted): ``contrastive`` (L_clip), ``global_hn`` (lambda_g L^g_neg), ``local_hn``
(lambda_l L^l_neg).

What this module decides that the paper leaves open (and how the authors' code, ytaek-oh/fsc-clip@604015d
``src/training/losses/loss.py``, does it — docs/methods.md §2.3, §6.1-6.3):
- L_clip uses positives only: hard negatives are NOT extra in-batch columns (as the code's ``Global_HNLoss``).
  It gathers across ranks (``common.clip_contrastive_loss``); the HN losses are per-sample and use local
  features only, as in the code.
- Missing negatives. The authors' code keeps a missing negative as a zero vector, i.e. logit 0, inside the
  (1+K)-way softmax (``_fill_empty_negatives``), which adds a spurious e^0 to the denominator of eq. (3)/(5).
  We implement the paper's intent (appendix A.1: missing negatives "are masked out and excluded from the hard
  negative loss"): their logit is -inf, so p = 0 and they receive no label mass. Rows without any valid
  negative are dropped and the HN losses average over the remaining rows (as the code's ``valid_neg_weight``);
  if no row has a negative, the term is an exact 0 that stays in the graph with a finite (zero) gradient.
- SCR label smoothing (eq. 10) spreads beta over the 1 + n_i VALID candidates of row i (n_i = valid negatives),
  as the code does: y_0 = 1 - beta + beta/(1+n_i), y_k = beta/(1+n_i). The focal factor (1-p_c)^gamma of
  eq. (9) is applied per class (also on the small negative-class terms) and is differentiated through, as in the
  code's ``_focal_loss_with_nsr``.
- LHN (eq. 5-8): s_{w,p} = t_w . v_p on the un-normalised projected tokens, DETACHED (the attention weights of
  eq. (6)-(7) carry no gradient; the gradient flows through v_p in the weighted mean and through t_w in the
  cosine), as in the code. Eq. (8)'s log S_l = logsumexp_w(logit_scale * cos(v^_w, t_w)) over the valid tokens
  of the text is the logit of the (1+K)-way choice.
- Weights of eq. (6) (appendix B.1, ``lhn_weighting``): 'minmax' (default, eq. 6), 'sparse' (minmax, then values
  < 1/P set to 0, as SPARC and the code's ``sim_sparsify``), 'softmax' (softmax over patches of the raw
  detached s, no temperature, as the code). The authors' min-max has no epsilon, so a constant row of s gives
  0/0 = NaN; we give such a row uniform weights (v^_w = mean patch) instead.
- A candidate text whose token mask is empty cannot be scored by eq. (8): a negative without tokens counts as
  missing in L^l_neg, and a row whose positive has no token is dropped from L^l_neg. (The data layer always
  keeps EOT, so this is a guard, not a path the sample world takes.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import clip_contrastive_loss, masked_mean, weighted_term

LHN_WEIGHTINGS = ("minmax", "sparse", "softmax")


def selective_calibrated_loss(logits: torch.Tensor, neg_valid: torch.Tensor, focal_gamma: float,
                              label_smoothing: float) -> torch.Tensor:
    """SCR (eq. 9-10) over (1+K)-way logits whose column 0 is the positive; mean over rows with a valid negative.

    logits [R, 1+K] (missing negatives may hold any value: they are masked here), neg_valid [R, K] bool.
    """
    keep = neg_valid.any(dim=1)                                        # rows with >= 1 valid negative
    logits = torch.where(keep[:, None], logits, 0.0)                   # other rows: finite, masked out below
    valid = torch.cat([torch.ones_like(neg_valid[:, :1]), neg_valid], dim=1)          # [R, 1+K]
    log_p = F.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=1)           # eq. (3)/(5): log p_{i,k}
    p = log_p.exp()                                                                    # 0 for missing classes
    log_p = log_p.masked_fill(~valid, 0.0)          # missing classes: p = 0 and y = 0; avoid 0 * (-inf)
    n_i = neg_valid.sum(dim=1, keepdim=True).to(logits.dtype)
    y = valid.to(logits.dtype) * label_smoothing / (1 + n_i)                           # eq. (10), valid only
    y[:, 0] += 1 - label_smoothing
    focal = (1 - p).clamp_min(0).pow(focal_gamma)                                      # eq. (9): (1 - p)^gamma
    rows = (y * focal * -log_p).sum(dim=1)                                             # eq. (9): sum_k ... l_{i,k}
    return masked_mean(rows, keep)                                     # no row with a negative: 0, in the graph


def global_hn_logits(image: torch.Tensor, text: torch.Tensor, neg_text: torch.Tensor,
                     logit_scale: torch.Tensor) -> torch.Tensor:
    """logit_scale * cos(v_i, [t_i, t~_i^1..K]) -> [B, 1+K]; the log of S_g in eq. (1), used by eq. (3)."""
    candidates = torch.cat([text.unsqueeze(1), neg_text], dim=1)                       # [B, 1+K, D]
    return logit_scale * torch.einsum("bd,bkd->bk", image, candidates)


def global_hn_loss(image, text, neg_text, neg_valid, logit_scale, focal_gamma, label_smoothing) -> torch.Tensor:
    """L^g_neg (eq. 3-4) under SCR: Focal(p^g, y~)."""
    logits = global_hn_logits(image, text, neg_text, logit_scale)
    return selective_calibrated_loss(logits, neg_valid, focal_gamma, label_smoothing)


def patch_attention_weights(sim: torch.Tensor, weighting: str = "minmax") -> torch.Tensor:
    """Eq. (6) and the sum-normalisation of eq. (7): a_{w,p} / sum_p a_{w,p}, from detached s [..., P]."""
    sim = sim.detach()                                                   # no gradient through the weights
    if weighting == "softmax":
        return sim.softmax(dim=-1)
    s_min, s_max = sim.amin(dim=-1, keepdim=True), sim.amax(dim=-1, keepdim=True)
    span = s_max - s_min
    constant = span <= 0
    a = (sim - s_min) / torch.where(constant, torch.ones_like(span), span)            # eq. (6)
    a = torch.where(constant, torch.ones_like(a), a)                 # constant row: uniform, not 0/0 = NaN
    if weighting == "sparse":
        a = a.masked_fill(a < 1.0 / sim.shape[-1], 0.0)              # the max patch keeps a = 1
    elif weighting != "minmax":
        raise ValueError(f"lhn_weighting must be one of {LHN_WEIGHTINGS}, got {weighting!r}")
    return a / a.sum(dim=-1, keepdim=True)                                            # eq. (7): 1 / sum_p a


def textual_aligned_patches(patches: torch.Tensor, tokens: torch.Tensor, weighting: str = "minmax") -> torch.Tensor:
    """V^ = {v^_w} (eq. 6-7): patches [B, P, D], tokens [B, C, L, D] -> [B, C, L, D] (not normalised)."""
    sim = torch.einsum("bcld,bpd->bclp", tokens, patches)                # s_{w,p} = t_w^T v_p
    a = patch_attention_weights(sim, weighting)
    return torch.einsum("bclp,bpd->bcld", a, patches)                    # eq. (7): sum_p a_{w,p} v_p


def local_similarity_logits(patches, tokens, token_mask, logit_scale, weighting="minmax") -> torch.Tensor:
    """log S_l(I, T) of eq. (8) = logsumexp_w logit_scale * cos(v^_w, t_w) over valid tokens -> [B, C].

    A text without any valid token gets -inf.
    """
    v_hat = textual_aligned_patches(patches, tokens, weighting)
    cos = torch.einsum("bcld,bcld->bcl", F.normalize(v_hat, dim=-1), F.normalize(tokens, dim=-1))
    has_tokens = token_mask.any(dim=-1, keepdim=True)
    # a text without tokens (e.g. a missing negative) is scored over all positions and then set to -inf, so
    # that the backward of logsumexp never sees an all -inf row (exp(-inf - -inf) = NaN, even times 0)
    scaled = (logit_scale * cos).masked_fill(~token_mask & has_tokens, float("-inf"))
    return torch.logsumexp(scaled, dim=-1).masked_fill(~has_tokens[..., 0], float("-inf"))   # eq. (8), log


def local_hn_loss(patches, tokens, token_mask, neg_valid, logit_scale, focal_gamma, label_smoothing,
                  weighting="minmax") -> torch.Tensor:
    """L^l_neg (eq. 5) under SCR: Focal(p^l, y~) with p^l from the local scores of eq. (8)."""
    token_mask = token_mask.bool()
    logits = local_similarity_logits(patches, tokens, token_mask, logit_scale, weighting)   # [B, 1+K]
    has_tokens = token_mask.any(dim=-1)                                                     # [B, 1+K]
    neg_valid = neg_valid.bool() & has_tokens[:, 1:] & has_tokens[:, :1]   # no positive tokens: drop row
    return selective_calibrated_loss(logits, neg_valid, focal_gamma, label_smoothing)


class FscClipLoss(nn.Module):
    """FSC-CLIP's objective (eq. 11) as named, weighted terms: contrastive, global_hn, local_hn."""

    def __init__(self, lambda_g: float = 0.5, lambda_l: float = 0.5, focal_gamma: float = 2.0,
                 label_smoothing: float = 0.02, lhn_weighting: str = "minmax"):
        super().__init__()
        if lhn_weighting not in LHN_WEIGHTINGS:
            raise ValueError(f"lhn_weighting must be one of {LHN_WEIGHTINGS}, got {lhn_weighting!r}")
        self.lambda_g, self.lambda_l = float(lambda_g), float(lambda_l)
        self.focal_gamma, self.label_smoothing = float(focal_gamma), float(label_smoothing)
        self.lhn_weighting = lhn_weighting

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        f = features
        scale = f["logit_scale"]
        terms = {"contrastive": clip_contrastive_loss(f["image"], f["text"], scale)}          # eq. (2)
        zero = f["image"].sum() * 0.0
        terms["global_hn"] = weighted_term(self.lambda_g, zero, lambda: global_hn_loss(         # eq. (11)
            f["image"], f["text"], f["neg_text"], f["neg_valid"].bool(), scale,
            self.focal_gamma, self.label_smoothing))
        terms["local_hn"] = weighted_term(self.lambda_l, zero, lambda: local_hn_loss(           # eq. (11)
            f["patches"], f["text_tokens"], f["text_mask"], f["neg_valid"], scale,
            self.focal_gamma, self.label_smoothing, self.lhn_weighting))
        return terms
