"""MulCLIP: global (long + summary caption), word-patch reconstruction (WPR) and subcaption-aggregated patch
(SAP) alignment over locally calibrated tokens.

    L_total = L_global + lambda_W L_Word(v', t') + lambda_S L_Sub(v', t_eot^sub)                   # eq. (11)

with lambda_short = 0.5, lambda_W = lambda_S = 1 (§4.1). No public code exists (docs/methods.md §5); every choice the
paper leaves open is ours:

* **L_contrast** is SigLIP's sigmoid loss (§3.2 "We adopt a sigmoid-based contrastive loss ... for all
  L_contrast terms"): -(1/n) sum_i sum_j log sigmoid(z_ij (s cos_ij + b)), z = +1 for the positive, -1
  otherwise; s and b learnable, initialised at 10 and -10 (SigLIP / open_clip). `contrast="softmax"` swaps in
  CLIP's symmetric InfoNCE (learnable scale, init 100). Each objective has its OWN head (scale, bias):
  `global` (long and summary caption share it), `word` (WPR) and `sub` (SAP): their positive/negative ratios
  differ (B x B vs within-sample rP x rP). The model's own logit_scale is NOT used by MulCLIP (it gets no
  gradient: DDP needs find_unused_parameters, or freeze it).
* **Batch-level terms** (L_global, L_Sub) gather across ranks (`common.gather_features`); in sigmoid mode the
  local image rows meet the gathered text columns, so every pair of the global batch is scored once (open_clip's
  SigLipLoss normalisation: per local row).
* **L_global (eq. 3)**: image vs long caption + lambda_short x image vs summary, the summary being the first
  sentence. It is `text_short` if given, else sub-caption 0 (whose validity then masks that term's rows and
  columns).
* **Local token calibration (eq. 4)**: separate modules for patches and long-caption tokens
  (`mulclip_modules.TokenCalibration`), N' = round(token_ratio x N) with N = number of patches P, or the text
  context length L (padding positions included; they are masked out of the softmax so a padded token never
  contributes; every one of the N' outputs is a convex combination of valid tokens). d_k = d/2. The long
  caption's local tokens t_loc^long exclude SOT, padding and (with `drop_eot`, default, eq. 2 separates them)
  the EOT token, whose embedding is already t_eot^long.
* **WPR (eqs. 5-8)**: A_{v->t} = softmax(v' t'^T / sqrt d), V' = A_{v->t} t' (and symmetrically T'), raw
  (unnormalised) projected tokens in the attention as eq. (5) writes it; then per sample a sigmoid contrast
  of the rP x rP cosine matrix between each refined token and the reconstructions (positive: its own), mean
  over tokens (eq. 7), summed over both modalities (eq. 8), averaged over the samples. No other sample is
  involved. A sample whose long caption has no local token is skipped (counted).
* **SAP (eqs. 9-10)**: for each sentence index i, image b's aggregate v-bar^i_b = softmax(t_sub,b,i v'_b^T /
  sqrt d) v'_b (its own sub-caption i over its own refined patches, "relevant patches" = this soft attention)
  is scored against t_sub,i of every image in a B x B (gathered) contrast; rows and columns where sentence i
  is missing are masked. At most `max_subcaptions` (15) sentences; extra ones are dropped and counted. The
  1/M of eq. (10) is applied per valid sub-caption: L_Sub = sum over valid (b, i) of row losses / their number
  (equal to eq. 10 when every image has M sentences; otherwise every sub-caption weighs the same).

Learnable modules and the optimiser: every parameter of this module is new (two `TokenCalibration`s, three
`ContrastHead`s), so `loss.parameters()` are exactly MulCLIP's new modules: put them in their own
group (paper: lr 2e-4 vs backbone 1e-5; no weight decay on the heads' scale/bias, as open_clip). Under DDP the
loss module must be a submodule of the DDP-wrapped module (or its grads all-reduced), else ranks diverge.

Features dict expected by `MulClipLoss.forward` (B per-rank batch, P patches, L text context, S <= 15, D embed):

    image        [B, D]    v_cls (normalised)
    text         [B, D]    t_eot^long, long caption (normalised)
    text_short   [B, D]    optional: t_eot^short, summary caption (normalised); default sub_text[:, 0]
    patches      [B, P, D] v_loc, projected patch tokens (image_features(x)["patches"])
    text_tokens  [B, L, D] projected long-caption token states (text_features(tok)["tokens"])
    text_mask    [B, L]    bool, keeps EOT, drops SOT and padding (text_features(tok)["mask"])
    sub_text     [B, S, D] t_eot,i^sub, sub-caption (sentence) embeddings, raw projected as eq. (9)'s attention
                           queries them (the contrasts normalise); placeholders finite
    sub_valid    [B, S]    bool, sentence i exists

Returned terms (already weighted): `contrastive` (image vs long caption), `contrastive_short` (x lambda_short),
`word_patch` (L_Word x lambda_W), `subcaption_patch` (L_Sub x lambda_S). A term whose lambda is 0 is a
graph-connected zero and its inputs are not read (lambda_W = lambda_S = 0, the "Global only" ablation, needs
`image`, `text` and `text_short` or `sub_text`/`sub_valid`). After each call `self.stats` holds 0-dim count tensors
on the device (never in the returned dict, never read in the step; tests read them):
`n_subcaptions`, `n_subcaptions_dropped` (beyond max_subcaptions), `n_wpr_skipped` (no local text token).
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .common import contrastive_labels, gather_features, masked_mean, weighted_term
from .mulclip_modules import ContrastHead, TokenCalibration


def contrast_rows(a, b, all_a, all_b, labels, valid, all_valid, head: ContrastHead) -> torch.Tensor:
    """Per-row L_contrast of G independent problems: local rows a, b [G, n, d] vs columns all_a, all_b [G, N, d].

    Row i's positive is column labels[i]; columns with all_valid False are left out, rows with valid False
    give 0. sigmoid: sum_j -log sigmoid(z_ij (s cos(a_i, b_j) + b)); softmax: the mean of both InfoNCE
    directions. Returns [G, n].
    """
    an, bn = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    all_an, all_bn = F.normalize(all_a, dim=-1), F.normalize(all_b, dim=-1)
    target = labels.expand(a.shape[0], -1)[..., None]                    # [G, n, 1]
    if head.kind == "sigmoid":
        logits = head.scale() * an @ all_bn.transpose(1, 2) + head.logit_bias
        z = torch.full_like(logits, -1.0).scatter(-1, target, 1.0)
        per_pair = (-F.logsigmoid(z * logits)).masked_fill(~all_valid[:, None, :], 0.0)
        rows = per_pair.sum(dim=-1)
    else:
        keep = all_valid | ~all_valid.any(dim=-1, keepdim=True)           # an empty problem: no -inf rows
        drop = ~keep[:, None, :]
        l_ab = (head.scale() * an @ all_bn.transpose(1, 2)).masked_fill(drop, float("-inf"))
        l_ba = (head.scale() * bn @ all_an.transpose(1, 2)).masked_fill(drop, float("-inf"))
        rows = -(l_ab.log_softmax(-1).gather(-1, target) + l_ba.log_softmax(-1).gather(-1, target))[..., 0] / 2
    return rows.masked_fill(~valid, 0.0)


def batch_contrast(image: torch.Tensor, text: torch.Tensor, head: ContrastHead,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """L^batch_contrast between paired rows over the gathered batch, averaged over the valid local rows."""
    if valid is None:
        valid = torch.ones(image.shape[0], dtype=torch.bool, device=image.device)
    image = torch.where(valid[:, None], image, torch.zeros_like(image))
    text = torch.where(valid[:, None], text, torch.zeros_like(text))
    all_image, all_text, all_valid = gather_features(image, text, valid.to(image.dtype))
    labels = contrastive_labels(image.shape[0], image.device)
    rows = contrast_rows(image[None], text[None], all_image[None], all_text[None], labels,
                         valid[None], all_valid.bool()[None], head)
    return rows.sum() / valid.sum().clamp(min=1)


def global_loss(image, text_long, text_short, short_valid, head, lambda_short):
    """L_global = L(v_cls, t_eot^long) + lambda_short L(v_cls, t_eot^short), returned as its two terms."""
    return (batch_contrast(image, text_long, head),                                              # eq. (3)
            lambda_short * batch_contrast(image, text_short, head, short_valid))


def drop_last_token(mask: torch.Tensor) -> torch.Tensor:
    """The mask without each row's last True position (the EOT token)."""
    count = mask.long().cumsum(dim=1)
    return mask & (count < count[:, -1:])


def reconstruct(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """A = SoftMax(query keys^T / sqrt d) (eq. 5); reconstruction = A keys (eq. 6). [B, n, d] x [B, m, d]."""
    attn = (query @ keys.transpose(1, 2) / math.sqrt(query.shape[-1])).softmax(dim=-1)           # eq. (5)
    return attn @ keys                                                                             # eq. (6)


def word_patch_reconstruction_loss(v_ref: torch.Tensor, t_ref: torch.Tensor, head: ContrastHead,
                                   valid: torch.Tensor) -> torch.Tensor:
    """L_Word = L_recon^image(v', V') + L_recon^text(t', T'), each a within-sample contrast (no gather)."""
    recon_v = reconstruct(v_ref, t_ref)                                 # V' = A_{v->t} t'
    recon_t = reconstruct(t_ref, v_ref)                                 # T' = A_{t->v} v'

    def recon_loss(tokens, recon):                                      # eq. (7): 1/rN sum_i L^sample
        b, n, _ = tokens.shape
        labels = torch.arange(n, device=tokens.device)
        ones = torch.ones(b, n, dtype=torch.bool, device=tokens.device)
        return contrast_rows(tokens, recon, tokens, recon, labels, ones, ones, head).mean(dim=-1)

    per_sample = recon_loss(v_ref, recon_v) + recon_loss(t_ref, recon_t)                          # eq. (8)
    return masked_mean(per_sample, valid)                              # empty: 0, still in the graph


def aggregate_patches(sub: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """alpha^i = SoftMax(t_sub,i v'^T / sqrt d), v-bar^i = alpha^i v' for every sentence i: [B,S,d]."""
    return reconstruct(sub, v_ref)                                                                 # eq. (9)


def subcaption_aggregated_patch_loss(v_bar: torch.Tensor, sub: torch.Tensor, valid: torch.Tensor,
                                     head: ContrastHead) -> torch.Tensor:
    """L_Sub = (1/M) sum_i L^batch(v-bar^i, t_sub,i), per sentence index i a masked B x B contrast."""
    all_v, all_sub, all_valid = gather_features(v_bar, sub, valid.to(sub.dtype))
    labels = contrastive_labels(sub.shape[0], sub.device)
    rows = contrast_rows(v_bar.transpose(0, 1), sub.transpose(0, 1), all_v.transpose(0, 1),
                         all_sub.transpose(0, 1), labels, valid.T, all_valid.bool().T, head)  # [S, B]
    return rows.sum() / valid.sum().clamp(min=1)                                                  # eq. (10)


class MulClipLoss(nn.Module):
    """MulCLIP's eq. (11); owns its new modules. See the module docstring for the features dict."""

    def __init__(self, embed_dim: int, n_patches: int, context_length: int, token_ratio: float = 0.5,
                 key_dim: int | None = None, lambda_short: float = 0.5, lambda_word: float = 1.0,
                 lambda_sub: float = 1.0, max_subcaptions: int = 15,
                 contrast: Literal["sigmoid", "softmax"] = "sigmoid", drop_eot: bool = True):
        super().__init__()
        self.patch_calibration = TokenCalibration(n_patches, embed_dim, token_ratio, key_dim)
        self.text_calibration = TokenCalibration(context_length, embed_dim, token_ratio, key_dim)
        self.heads = nn.ModuleDict({k: ContrastHead(contrast) for k in ("global", "word", "sub")})
        self.lambda_short, self.lambda_word, self.lambda_sub = lambda_short, lambda_word, lambda_sub
        self.max_subcaptions = max_subcaptions
        self.drop_eot = drop_eot
        self.stats: dict[str, torch.Tensor] = {}

    def calibrate(self, patches: torch.Tensor, text_tokens: torch.Tensor, text_mask: torch.Tensor):
        """v' = calib_v(v_loc), t' = calib_t(t_loc^long) (eq. 4); also the mask of samples with local text."""
        local_mask = drop_last_token(text_mask) if self.drop_eot else text_mask
        return (self.patch_calibration(patches), self.text_calibration(text_tokens, local_mask),
                local_mask.any(dim=1))

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        f = features
        needs_sub = self.lambda_sub != 0 or f.get("text_short") is None
        if needs_sub:
            sub_all, sub_valid_all = f["sub_text"], f["sub_valid"].bool()
            sub, sub_valid = sub_all[:, :self.max_subcaptions], sub_valid_all[:, :self.max_subcaptions]
            sub = torch.where(sub_valid[..., None], sub, torch.zeros_like(sub))   # finite, never in a loss
            self.stats = {"n_subcaptions": sub_valid.sum(),
                          "n_subcaptions_dropped": sub_valid_all[:, self.max_subcaptions:].sum()}
        else:
            self.stats = {}
        if f.get("text_short") is not None:
            short, short_valid = f["text_short"], None
        else:
            short, short_valid = sub[:, 0], sub_valid[:, 0]
        g_long, g_short = global_loss(f["image"], f["text"], short, short_valid, self.heads["global"],
                                      self.lambda_short)
        terms = {"contrastive": g_long, "contrastive_short": g_short}
        zero = f["image"].sum() * 0.0
        if self.lambda_word == 0 and self.lambda_sub == 0:                # global-only ablation: no token inputs
            return dict(terms, word_patch=zero, subcaption_patch=zero)
        v_ref, t_ref, has_text = self.calibrate(f["patches"], f["text_tokens"], f["text_mask"].bool())
        self.stats["n_wpr_skipped"] = (~has_text).sum()
        terms["word_patch"] = weighted_term(self.lambda_word, zero, lambda: word_patch_reconstruction_loss(
            v_ref, t_ref, self.heads["word"], has_text))
        terms["subcaption_patch"] = weighted_term(self.lambda_sub, zero, lambda: subcaption_aggregated_patch_loss(
            aggregate_patches(sub, v_ref), sub, sub_valid, self.heads["sub"]))
        return terms
