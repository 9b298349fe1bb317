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

AdamW (open_clip's parameter groups for the tower: no decay on gains, biases and embeddings) with linear warm-up and
cosine decay; batches drawn with a generator seeded by `seed`, so the result is a function of the inputs.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .optim import cosine_with_warmup, parameter_groups

log = logging.getLogger("clipfinetune.train")


def label_warmup(model, images: torch.Tensor, labels: torch.Tensor, *, steps: int, lr: float, batch_size: int,
                 warmup: int = 0, wd: float = 0.0, seed: int = 0,
                 normalize: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch) -> list[float]:
    """Train `model`'s image tower for `steps` steps on (images, multi-hot labels [N, V]); returns the loss curve.
    Batches are drawn from the images with at least one label.

    `images` are stored batches that `normalize` turns into model input (`CaptionPairSource.images`/`.normalize`).
    """
    if len(images) != len(labels):
        raise ValueError(f"{len(images)} images but {len(labels)} label rows")
    labelled = torch.nonzero(labels.sum(1) > 0).flatten()          # images without labels take no part
    if len(labelled) == 0:
        raise ValueError("no image has a label")
    if steps < 1:
        return []
    visual = model.clip.visual
    device = next(visual.parameters()).device
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(model.embed_dim, labels.shape[1]).to(device)
    with torch.no_grad():                       # the head's init from the same seed (not the global RNG)
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * model.embed_dim ** -0.5)
        head.bias.zero_()
    groups = parameter_groups(visual, lr, wd) + [{"params": list(head.parameters()), "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-6)
    was_training = model.training
    model.train()
    curve = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * cosine_with_warmup(step, warmup, steps)
        idx = labelled[torch.randint(len(labelled), (min(batch_size, len(labelled)),), generator=g)]
        logits = head(model.encode_image(normalize(images[idx]).to(device), normalize=False))
        target = labels[idx].to(device, logits.dtype)
        loss = -(target / target.sum(1, keepdim=True) * F.log_softmax(logits, dim=1)).sum(1).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        curve.append(float(loss))
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log.info("label warm-up step %d/%d: loss %.4f", step + 1, steps, curve[-1])
    optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    return curve
