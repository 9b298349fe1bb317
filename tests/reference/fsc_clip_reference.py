"""Float64 per-sample reference of FSC-CLIP's losses, written from the paper's equations (Oh et al., 2024, §3).

Imports nothing from clipfinetune. Every function loops over samples / candidates / tokens and evaluates the
equations literally (exp of similarities, ratios, sums) so that it shares no code path with the module.
Conventions fixed by docs/methods.md and the module docstring: missing negatives are excluded from the choice and
from the labels; rows without a valid negative are dropped; label smoothing spreads beta over the 1 + n_i
valid candidates; tau = 1 / logit_scale.
"""
import math

import torch


def cos(a, b):
    return (a * b).sum() / (a.norm() * b.norm())


def unit_cos(a, b):
    """cos of two vectors given as L2-normalised (the global embeddings are), i.e. v^T t."""
    return (a * b).sum()


def clip_loss(image, text, logit_scale, label_smoothing=0.0):
    """L_clip = (L_i2t + L_t2i) / 2, eq. (1)-(2); with label smoothing eps the target of row i is
    (1 - eps) on its pair plus eps / B on every column (eps = 0 in FSC-CLIP)."""
    b, eps = image.shape[0], label_smoothing
    s_g = [[torch.exp(logit_scale * unit_cos(image[i], text[j])) for j in range(b)] for i in range(b)]   # eq. (1)
    l_i2t = l_t2i = 0.0
    for i in range(b):
        row = sum(s_g[i][j] for j in range(b))                                  # image i against every text
        col = sum(s_g[j][i] for j in range(b))                                  # text i against every image
        l_i2t = l_i2t - (1 - eps) * torch.log(s_g[i][i] / row) - eps / b * sum(
            torch.log(s_g[i][j] / row) for j in range(b))                      # eq. (2)
        l_t2i = l_t2i - (1 - eps) * torch.log(s_g[i][i] / col) - eps / b * sum(
            torch.log(s_g[j][i] / col) for j in range(b))
    return (l_i2t / b + l_t2i / b) / 2


def scr(similarities, valid, gamma, beta):
    """Focal(p_i, y~_i) (eq. 9-10) averaged over rows with a valid negative.

    similarities: list over rows of lists [S(I_i, T_i), S(I_i, T~_i^1), ...] (positive numbers, eq. 1 or 8);
    valid: list over rows of lists of bools for the negatives.
    """
    losses = []
    for s_row, v_row in zip(similarities, valid):
        kept = [0] + [1 + k for k, ok in enumerate(v_row) if ok]
        if len(kept) == 1:
            continue                                            # no valid negative: row dropped
        denom = sum(s_row[c] for c in kept)
        n = len(kept) - 1
        loss = 0.0
        for c in kept:
            p = s_row[c] / denom                                # eq. (3) / (5)
            y = (1 - beta) * (1.0 if c == 0 else 0.0) + beta / (1 + n)      # eq. (10) over the valid candidates
            loss = loss + (1 - p) ** gamma * (-y * torch.log(p))            # eq. (9)
        losses.append(loss)
    if not losses:
        return torch.zeros((), dtype=torch.float64)
    return sum(losses) / len(losses)


def global_hn_loss(image, text, neg_text, neg_valid, logit_scale, gamma, beta):
    """L^g_neg, eq. (3)-(4) under SCR."""
    sims, valid = [], []
    for i in range(image.shape[0]):
        row = [torch.exp(logit_scale * unit_cos(image[i], text[i]))]
        row += [torch.exp(logit_scale * unit_cos(image[i], neg_text[i, k])) for k in range(neg_text.shape[1])]
        sims.append(row)
        valid.append([bool(x) for x in neg_valid[i]])
    return scr(sims, valid, gamma, beta)


def attention_weights(s, weighting):
    """Eq. (6) for one token: s [P] -> a [P] (constant row -> uniform); appendix B.1 variants."""
    p = s.shape[0]
    if weighting == "softmax":
        e = [math.exp(float(s[q] - s.max())) for q in range(p)]
        return torch.tensor(e, dtype=torch.float64)
    lo, hi = float(s.min()), float(s.max())
    if hi == lo:
        return torch.ones(p, dtype=torch.float64)
    a = [(float(s[q]) - lo) / (hi - lo) for q in range(p)]
    if weighting == "sparse":
        a = [x if x >= 1.0 / p else 0.0 for x in a]
    return torch.tensor(a, dtype=torch.float64)


def local_similarity(patches, tokens, token_mask, logit_scale, weighting="minmax", detach_weights=True):
    """S_l(I, T), eq. (6)-(8): patches [P, D], tokens [L, D], token_mask [L] -> positive scalar (or None)."""
    total, any_token = 0.0, False
    for w in range(tokens.shape[0]):
        if not bool(token_mask[w]):
            continue
        any_token = True
        t_w = tokens[w]
        s = torch.stack([t_w @ patches[q] for q in range(patches.shape[0])])   # s_{w,p} = t_w^T v_p
        if detach_weights:
            a = attention_weights(s.detach(), weighting)
        else:                                                   # differentiable minmax, to show detach matters
            a = (s - s.min()) / (s.max() - s.min())
        v_hat = sum(a[q] * patches[q] for q in range(patches.shape[0])) / a.sum()        # eq. (7)
        total = total + torch.exp(logit_scale * cos(v_hat, t_w))                         # eq. (8)
    return total if any_token else None


def local_hn_loss(patches, tokens, token_mask, neg_valid, logit_scale, gamma, beta, weighting="minmax",
                  detach_weights=True):
    """L^l_neg, eq. (5) under SCR. tokens [B, 1+K, L, D], token_mask [B, 1+K, L], neg_valid [B, K]."""
    sims, valid = [], []
    for i in range(patches.shape[0]):
        row = [local_similarity(patches[i], tokens[i, c], token_mask[i, c], logit_scale, weighting,
                                detach_weights) for c in range(tokens.shape[1])]
        if row[0] is None:
            continue                                            # positive without tokens: cannot be scored
        ok = [bool(neg_valid[i, k]) and row[1 + k] is not None for k in range(neg_valid.shape[1])]
        sims.append([x if x is not None else 0.0 for x in row])
        valid.append(ok)
    return scr(sims, valid, gamma, beta)
