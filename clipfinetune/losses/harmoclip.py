"""HarmoCLIP (Zeng et al., arXiv 2511.22594): global contrast + lexeme-region contrast + global-region alignment.

    L = L_GC + lambda_lrc * L_LRC + lambda_gr * L_GR                                              # eq. (9)

The paper writes eq. (9) with unit weights; lambda_lrc and lambda_gr (default 1) are ours, for the ablations.
The authors' code could not be read (docs/methods.md §1.1), so everything below that the paper leaves open is our
decision:

* **Lexeme feature l_i (eqs. 3-4).** The paper takes the word's hidden state h_{token_idx} from the text
  transformer's output sequence "with the final projection layer removed" (§4.2), so the word-region gradient
  must not train the projection that makes the global text embedding t_i. Eq. (7) still compares l_i with the
  region feature r_i by cosine, and r_i lives in the joint embedding space (MaskCLIP's last block + ln_post +
  the visual projection, then RoIAlign, eqs. 5-6). Our reading (`lexeme_projection_grad=False`, the default):
  l_i = ln_final(h_{token_idx}) @ stop_grad(text_projection). h is the transformer output after its final
  LayerNorm (the HF/FG-CLIP `last_hidden_state` convention); the projection is applied as a fixed linear map
  that only carries h into r_i's space, so L_LRC trains the text transformer and ln_final, never the
  projection shared with t_i. (Comparing the raw width-W states with r_i directly is possible only when W = D
  and would align two unrelated bases, so we do not.) The earlier variant, `lexeme_projection_grad=True`,
  lets the L_LRC gradient into the projection too (FSC-CLIP's projected tokens, docs/methods.md §1.4). Either way
  the method hands this loss `text_tokens` = the projected token states of `model.text_features(tok,
  detach_token_projection=not lexeme_projection_grad)`; the values are the same, only the gradient path differs.
* **Multi-token words.** A word split into several BPE tokens is mean-pooled over its tokens
  (`word_mask`), then L2-normalised; s(.,.) in eq. (1) is a cosine.
* **Pairs per sample.** As in the paper's data (supplementary §7) each sample carries one caption with one
  matched word and that word's box, so L_LRC has one word-region pair per sample; a caption with several
  matched words is several samples (rows of `word_regions.parquet`).
* **Batching of L_LRC.** Symmetric InfoNCE (both directions, as eq. 7 is written) over the pairs of the
  global batch (gathered across ranks, local rows against gathered columns, as `common.clip_contrastive_loss`).
  The temperature tau of eq. (7) is the model's learnable logit_scale, shared with L_GC ("similar to Global
  Contrastive Learning").
* **Padding never enters the softmax.** A sample whose pair is invalid (`pair_valid` False, or an empty
  `word_mask`) is neither a row nor a column of L_LRC nor a term of L_GR (FineCLIP's zero-padded rows stay in
  its softmax, docs/methods.md §1.2 pitfall; we do not repeat that).
* **Same-category false negatives** (`mask_same_category`, default False = eq. 7 as written): when on, an
  off-diagonal pair (i, j) whose words name the same category is removed from both softmaxes; the diagonal
  always stays.
* **L_GR target (eq. 8).** E_i is a FROZEN teacher CLIP's embedding of the region crop (computed by the caller
  under no_grad); the loss detaches it again so no gradient can reach the teacher. This deliberately differs
  from FineCLIP, whose "teacher" crop embedding is the live student (docs/methods.md §6.16). L_GR is a per-sample
  term (no gather), averaged over the valid pairs of the rank.

Features dict expected by `HarmoClipLoss.forward` (B = per-rank batch, L = text length, D = embed dim):

    image          [B, D]  global image embedding v_i (normalised)
    text           [B, D]  global caption embedding t_i (normalised)
    logit_scale    []      exp(learnable log-temperature) = 1/tau, shared by L_GC and L_LRC
    text_tokens    [B, L, D] projected caption token states (see "Lexeme feature": projection detached by default)
    word_mask      [B, L]  bool, True on the BPE tokens of the matched word (model.token_span)
    region         [B, D]  RoIAlign'd dense feature of the word's box R_i (model.region_features)
    region_teacher [B, D]  frozen teacher embedding E_i of the region crop (no grad needed)
    pair_valid     [B]     bool, optional (default: all True): the sample has a word-region pair
    category       [B]     long, needed only when mask_same_category: category id of the word

Returned terms (already weighted): `contrastive` (L_GC), `lexeme_region` (L_LRC), `global_region` (L_GR).
A term whose lambda is 0 is a graph-connected zero and its inputs are not read (with both 0 only `image`,
`text`, `logit_scale` are needed). After each call `self.stats` holds 0-dim count tensors on the device (never read
in the step; tests read them) (`n_pairs`: valid pairs on this rank, `n_without_pair`): counts are never put in the
returned dict, so every value the trainer sums is a loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import clip_contrastive_loss, masked_clip_contrastive_loss, masked_mean, weighted_term


def lexeme_features(text_tokens: torch.Tensor, word_mask: torch.Tensor) -> torch.Tensor:
    """l_i: mean of the word's projected token states W_target = h_{token_idx} (eqs. 3-4), L2-normalised.

    The projection of `text_tokens` is detached upstream by default (module docstring, "Lexeme feature")."""
    weights = word_mask.to(text_tokens.dtype)
    summed = torch.einsum("bl,bld->bd", weights, text_tokens)
    mean = summed / weights.sum(dim=1, keepdim=True).clamp(min=1.0)
    return F.normalize(mean, dim=-1)


def global_contrastive_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """L_GC: symmetric InfoNCE between v_i and t_i over the (gathered) batch."""
    return clip_contrastive_loss(image, text, logit_scale)                                      # eq. (2)


def lexeme_region_contrastive_loss(region: torch.Tensor, lexeme: torch.Tensor, logit_scale: torch.Tensor,
                                   valid: torch.Tensor, category: torch.Tensor | None = None) -> torch.Tensor:
    """L_LRC: symmetric InfoNCE between region features r_i and lexeme features l_i."""
    r = F.normalize(region, dim=-1)
    return masked_clip_contrastive_loss(r, lexeme, logit_scale, valid, groups=category)         # eq. (7)


def global_region_alignment_loss(region: torch.Tensor, region_teacher: torch.Tensor,
                                 valid: torch.Tensor) -> torch.Tensor:
    """L_GR = 1 - (1/B) sum_i <R_i/|R_i|, E_i/|E_i|>, E_i from the frozen teacher (detached)."""
    r = F.normalize(region, dim=-1)
    e = F.normalize(region_teacher.detach(), dim=-1)
    cos = (r * e).sum(dim=-1)
    loss = 1.0 - masked_mean(cos, valid)                                                        # eq. (8)
    return torch.where(valid.any(), loss, torch.zeros_like(loss))      # empty: 0, still in the graph


class HarmoClipLoss(nn.Module):
    """L = L_GC + lambda_lrc L_LRC + lambda_gr L_GR (eq. 9); see the module docstring for the features dict."""

    def __init__(self, lambda_lrc: float = 1.0, lambda_gr: float = 1.0, mask_same_category: bool = False):
        super().__init__()
        self.lambda_lrc = lambda_lrc
        self.lambda_gr = lambda_gr
        self.mask_same_category = mask_same_category
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        f = features
        logit_scale = f["logit_scale"]
        terms = {"contrastive": global_contrastive_loss(f["image"], f["text"], logit_scale)}
        zero = f["image"].sum() * 0.0
        if self.lambda_lrc == 0 and self.lambda_gr == 0:                 # ablation: no region inputs read
            self.stats = {}
            return dict(terms, lexeme_region=zero, global_region=zero)
        word_mask = f["word_mask"].bool()
        valid = word_mask.any(dim=1)
        if f.get("pair_valid") is not None:
            valid = valid & f["pair_valid"].bool()
        self.stats = {"n_pairs": valid.sum(), "n_without_pair": (~valid).sum()}
        category = f["category"] if self.mask_same_category else None
        terms["lexeme_region"] = weighted_term(self.lambda_lrc, zero, lambda: lexeme_region_contrastive_loss(
            f["region"], lexeme_features(f["text_tokens"], word_mask), logit_scale, valid, category))
        terms["global_region"] = weighted_term(self.lambda_gr, zero, lambda: global_region_alignment_loss(
            f["region"], f["region_teacher"], valid))
        return terms
