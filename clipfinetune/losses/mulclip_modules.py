"""MulCLIP's learnable modules: local token calibration (eq. 4) and the contrastive heads (scale, bias).

Everything here is NEW (not part of the pretrained CLIP) and trains at the higher learning rate of the paper
(new modules 2e-4, backbone 1e-5, §4.1). `MulClipLoss` owns one `TokenCalibration` per modality and one
`ContrastHead` per objective: `MulClipLoss.parameters()` are these modules' and nothing else.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def reduced_length(n: int, ratio: float) -> int:
    """N' = round(ratio * N), halves rounded up, at least 1."""
    return max(1, math.floor(ratio * n + 0.5))


class TokenCalibration(nn.Module):
    """Aggregation network (Zong et al., 2022): X' = SoftMax(W_q sigma(X W_k)^T / tau) X           # eq. (4)

    X [B, N, d] -> X' [B, N', d] with N' = round(ratio * N) learned queries (rows of W_q in R^{N' x d_k}),
    W_k in R^{d x d_k} (bias-free linear), sigma = GELU, tau a learnable temperature (stored as log tau, init
    tau = 1). The softmax runs over the N input tokens, so every output token is a convex combination of the
    (valid) inputs and stays in the joint embedding space. Padded inputs (mask False) get weight exactly 0;
    a row with no valid input at all attends uniformly (the caller must drop that sample).
    """

    def __init__(self, n_tokens: int, dim: int, ratio: float = 0.5, key_dim: int | None = None):
        super().__init__()
        self.n_tokens = n_tokens
        self.key_dim = key_dim or dim // 2                                   # d_k = d/2 (our choice)
        self.n_out = reduced_length(n_tokens, ratio)
        self.key = nn.Linear(dim, self.key_dim, bias=False)                 # W_k
        self.query = nn.Parameter(torch.randn(self.n_out, self.key_dim) * self.key_dim ** -0.5)   # W_q
        self.log_tau = nn.Parameter(torch.zeros(()))                        # tau = exp(log_tau)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[1] != self.n_tokens:
            raise ValueError(f"TokenCalibration built for {self.n_tokens} tokens, got {x.shape[1]}")
        logits = self.query @ F.gelu(self.key(x)).transpose(1, 2) / self.log_tau.exp()   # [B, N', N]
        if mask is not None:
            mask = mask.bool() | ~mask.bool().any(dim=1, keepdim=True)      # empty rows: uniform, not NaN
            logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        return logits.softmax(dim=-1) @ x                                     # eq. (4)


class ContrastHead(nn.Module):
    """The learnable temperature (and bias) of one L_contrast.

    `sigmoid` (SigLIP, Zhai et al. 2023): logits = exp(logit_scale) * cos + logit_bias, initialised as SigLIP
    and open_clip (scale 10, bias -10). `softmax` (CLIP InfoNCE): logits = exp(logit_scale) * cos, initialised
    at ln 100, the pretrained CLIP value Long-CLIP also re-initialises to (docs/methods.md §0.1); no bias.
    """

    def __init__(self, kind: str = "sigmoid"):
        super().__init__()
        if kind not in ("sigmoid", "softmax"):
            raise ValueError(f"contrast must be 'sigmoid' or 'softmax', got {kind!r}")
        self.kind = kind
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0 if kind == "sigmoid" else 100.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0)) if kind == "sigmoid" else None

    def scale(self) -> torch.Tensor:
        return self.logit_scale.exp()
