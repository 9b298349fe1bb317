"""Pieces every loss shares: gathering features across ranks, and the symmetric InfoNCE of CLIP.

`gather_features` is open_clip's `gather_features(local_loss=True, gather_with_grad=True)`: a differentiable
all-gather (torch's functional `all_gather_single_autograd`, the successor of the deprecated
`torch.distributed.nn.functional.all_gather`; its backward sums every rank's gradient into the owner). Each rank scores
its local rows against all gathered columns; summed over ranks and averaged by DDP this is exactly the gradient of one
process on the concatenated batch (tested). With one process it returns its inputs unchanged. Every in-batch contrastive
term calls it; per-sample terms (hard-negative choices, token losses, distillation) stay local.

`weighted_term` is how every loss module weights an optional term: a lambda of 0 gives a graph-connected zero
and the term (with its inputs) is never computed.

Rows that a term leaves out (a sample without a pair, a caption without negatives) are masked, never indexed out:
`masked_cross_entropy` / `masked_mean` average over the kept rows with no host read, so a training step never waits
for the device to say how many rows there are (an empty selection is an exact 0, in the graph).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORED = -100          # F.cross_entropy's ignore_index: the target of a row left out of the mean


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_features(*features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Differentiable all-gather along dim 0 (every rank must pass the same shapes)."""
    _, world_size = world()
    if world_size == 1:
        return features
    try:
        from torch.distributed._functional_collectives import all_gather_single_autograd
    except ImportError:  # torch < 2.5
        from torch.distributed.nn.functional import all_gather
        return tuple(torch.cat(all_gather(f.contiguous()), dim=0) for f in features)
    from torch.distributed._functional_collectives import wait_tensor

    return tuple(wait_tensor(all_gather_single_autograd(f.contiguous(), 0, dist.group.WORLD)) for f in features)


def weighted_term(weight: float, zero: torch.Tensor, term: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`weight * term()`, or `zero` (a 0 still in the graph) without calling `term` when the weight is 0, so that
    an ablated term's inputs need not be in the features dict."""
    return zero if weight == 0 else weight * term()


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`F.cross_entropy(logits[rows], target[rows])` without selecting on the host: the other rows are scored on
    zeros (finite, whatever they held) and ignored; 0, in the graph with a zero gradient, when no row is kept."""
    logits = torch.where(rows[:, None], logits, 0.0)
    loss = F.cross_entropy(logits, target.masked_fill(~rows, IGNORED), ignore_index=IGNORED)
    return torch.where(rows.any(), loss, torch.zeros_like(loss))      # no kept row: 0/0 in cross_entropy


def masked_mean(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`values[rows].mean()` without selecting on the host (0 when no row is kept; other rows may hold anything
    finite)."""
    return torch.where(rows, values, 0.0).sum() / rows.sum().clamp(min=1)


def contrastive_labels(n_local: int, device) -> torch.Tensor:
    """Indices of the local samples' positives inside the gathered batch."""
    rank, _ = world()
    return torch.arange(n_local, device=device) + rank * n_local


def clip_contrastive_loss(image: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor,
                          label_smoothing: float = 0.0) -> torch.Tensor:
    """Symmetric InfoNCE between L2-normalised image and text embeddings (CLIP's L_itc).

    The local rows are scored against the gathered columns of all ranks (open_clip's `local_loss=True`).
    """
    all_image, all_text = gather_features(image, text)
    labels = contrastive_labels(image.shape[0], image.device)
    logits_i2t = logit_scale * image @ all_text.T
    logits_t2i = logit_scale * text @ all_image.T
    return (F.cross_entropy(logits_i2t, labels, label_smoothing=label_smoothing)
            + F.cross_entropy(logits_t2i, labels, label_smoothing=label_smoothing)) / 2


def masked_clip_contrastive_loss(a: torch.Tensor, b: torch.Tensor, logit_scale: torch.Tensor,
                                 valid: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
    """Symmetric InfoNCE between paired rows a_i, b_i over the VALID pairs of the gathered batch.

    Invalid pairs are neither rows nor columns. With `groups`, off-diagonal pairs of the same group are removed
    from both softmaxes. Rows are averaged per direction over the valid local rows (eq. 7's 1/2N).
    """
    n = a.shape[0]
    zeros = torch.zeros_like(a)
    a = torch.where(valid[:, None], a, zeros)          # placeholder rows never carry NaN into the gradient
    b = torch.where(valid[:, None], b, zeros)
    extra = [valid.to(a.dtype)] + ([groups.to(a.dtype)] if groups is not None else [])
    all_a, all_b, all_valid, *all_groups = gather_features(a, b, *extra)
    labels = contrastive_labels(n, a.device)
    keep = all_valid.bool()[None, :].expand(n, -1)                       # columns: valid pairs only
    if groups is not None:
        same = groups.to(a.dtype)[:, None] == all_groups[0][None, :]
        diagonal = labels[:, None] == torch.arange(all_a.shape[0], device=a.device)[None, :]
        keep = keep & ~(same & ~diagonal)                                  # drop same-group negatives
    logits_ab = (logit_scale * a @ all_b.T).masked_fill(~keep, float("-inf"))
    logits_ba = (logit_scale * b @ all_a.T).masked_fill(~keep, float("-inf"))
    return (masked_cross_entropy(logits_ab, labels, valid) + masked_cross_entropy(logits_ba, labels, valid)) / 2
