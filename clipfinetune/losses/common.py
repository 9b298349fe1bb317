"""Pieces every loss shares: gathering features across ranks, and the symmetric InfoNCE of CLIP.

`gather_features` is open_clip's `gather_features(local_loss=True, gather_with_grad=True)`: a differentiable
all-gather (`torch.distributed.nn.functional.all_gather`, whose backward sums every rank's gradient into the
owner). Each rank scores its local rows against all gathered columns; summed over ranks and averaged by DDP
this is exactly the gradient of one process on the concatenated batch (tested). With one process it returns
its inputs unchanged. Every in-batch contrastive term calls it; per-sample terms (hard-negative choices,
token losses, distillation) stay local.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gather_features(*features: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Differentiable all-gather along dim 0 (every rank must pass the same shapes)."""
    _, world_size = world()
    if world_size == 1:
        return features
    from torch.distributed.nn.functional import all_gather

    return tuple(torch.cat(all_gather(f.contiguous()), dim=0) for f in features)


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
