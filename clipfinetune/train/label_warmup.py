"""Label warm-up of the image tower before contrastive pretraining (stage `pretrain`, sample world).

The base CLIP stands in for a web-pretrained model. Trained from scratch by the contrastive loss alone, the tiny ViT
stays shape-blind within the pretraining budget: colour separates most captions of a batch, both towers settle on
it, and once the text tower maps "a red circle" and "a red star" to nearly the same point (cosine 0.998) no gradient
asks the image tower for shape (issue 22). Like CLIPs whose image tower starts from supervised pretraining (LiT,
Zhai et al. 2022), the image tower here first learns to say what each pretraining image holds: a throw-away linear
head on the (unnormalised) image embedding predicts the image's labels (the shapes and colours present) with a
softmax cross-entropy against the multi-hot row divided by its sum (1/k on each of k labels; Mahajan et al. 2018,
"Exploring the limits of weakly supervised pretraining", found it better than per-label binary losses, and here it
learns shape faster than binary cross-entropy); the contrastive stage then trains both towers from these weights.

Region term (`regions`, optional): the same head also reads each object's region feature (`region_features`: the
MaskCLIP dense map RoIAligned to the object's box, L2-normalised, times a learnt scale) and predicts that object's
labels. Contrastive pretraining trains only the pooled CLS embedding; without this term the dense features that
box classification and region-level methods read never learn what sits where (box top-1 26% on 8 shapes while
whole-image zero-shot reached 92%, #22). A detector-style start, as CLIPs initialised from supervised backbones
have; with regions every image takes part (the image term only on images with labels).

AdamW (open_clip's parameter groups for the tower: no decay on gains, biases and embeddings) with linear warm-up and
cosine decay; batches drawn with a generator seeded by `seed`, so the result is a function of the inputs.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import autocast
from .optim import cosine_with_warmup, parameter_groups

log = logging.getLogger("clipfinetune.train")


def label_warmup(model, images: torch.Tensor, labels: torch.Tensor, *, steps: int, lr: float, batch_size: int,
                 warmup: int = 0, wd: float = 0.0, seed: int = 0,
                 normalize: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch,
                 regions: list[tuple[torch.Tensor, torch.Tensor]] | None = None, precision: str = "fp32") -> list[float]:
    """Train `model`'s image tower for `steps` steps on (images, multi-hot labels [N, V]); returns the loss curve.
    Batches are drawn from the images with at least one label, or from every image when `regions` (per image:
    boxes [k, 4] xyxy in input pixels, multi-hot labels [k, V]) adds the region term.

    `images` are stored batches that `normalize` turns into model input (`CaptionPairSource.images`/`.normalize`).
    `precision` "bf16": the forward under bf16 autocast, the loss in fp32 (as the training loop).
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} label rows")
    has_label = labels.sum(1) > 0
    if not has_label.any():
        raise ValueError("no image has a label")
    if regions is not None and len(regions) != len(images):
        raise ValueError(f"{len(images)} images but {len(regions)} region lists")
    pool = torch.arange(len(images)) if regions is not None else torch.nonzero(has_label).flatten()
    if steps < 1:
        return []
    visual = model.clip.visual
    device = next(visual.parameters()).device
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(model.embed_dim, labels.shape[1]).to(device)
    with torch.no_grad():                       # the head's init from the same seed (not the global RNG)
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * model.embed_dim ** -0.5)
        head.bias.zero_()
    region_scale = nn.Parameter(torch.tensor(10.0, device=device))   # cosine-classifier scale of the region term
    extra = list(head.parameters()) + ([region_scale] if regions is not None else [])
    groups = parameter_groups(visual, lr, wd) + [{"params": extra, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)
    was_training = model.training
    model.train()
    curve = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * cosine_with_warmup(step, warmup, steps)
        idx = pool[torch.randint(len(pool), (min(batch_size, len(pool)),), generator=g)]
        batch = normalize(images[idx]).to(device)
        with autocast(precision, device):
            if regions is None:
                logits = head(model.encode_image(batch, normalize=False))
                loss = _soft_cross_entropy(logits, labels[idx].to(device))
            else:               # one forward for both terms (the dense map shares blocks 0..L-2 with the embedding)
                features = model.image_features(batch, dense=True)
                rows = has_label[idx].to(device)
                loss = torch.zeros((), device=device)
                if rows.any():
                    logits = head(features["global_raw"][rows])
                    loss = loss + _soft_cross_entropy(logits, labels[idx][has_label[idx]].to(device))
                region = model.pool_regions(features["dense"], [regions[int(i)][0].to(device) for i in idx])
                target = torch.cat([regions[int(i)][1] for i in idx]).to(device)
                loss = loss + _soft_cross_entropy(head(region * region_scale), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        curve.append(loss.item())
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log.info("label warm-up step %d/%d: loss %.4f", step + 1, steps, curve[-1])
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return curve


def _soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against each multi-hot row divided by its sum (1/k on each of its k labels), in fp32 whatever
    the forward's precision."""
    logits, target = logits.float(), target.float()
    return -(target / target.sum(1, keepdim=True) * F.log_softmax(logits, dim=1)).sum(1).mean()
