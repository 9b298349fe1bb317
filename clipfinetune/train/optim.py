"""AdamW with open_clip's parameter groups, and the cosine schedule with linear warm-up.

open_clip (`open_clip_train/main.py`, METHODS.md 0.3): parameters with `ndim < 2` or whose name contains
`bn`, `ln`, `bias` or `logit_scale` get no weight decay; every other trainable parameter gets `wd`. A method may
claim parameters for its own learning rate (`Method.param_groups`, e.g. MulCLIP's new modules); those are split
by the same decay rule. Frozen parameters (`requires_grad=False`, e.g. teachers) are not optimised.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """open_clip's exclusion rule: norms, biases, gains, embeddings of ndim < 2, and the logit scale."""
    return param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def parameter_groups(module: nn.Module, lr: float, wd: float, extra_groups: list[dict] = (),
                     exclusions: bool = True) -> list[dict]:
    """Optimiser groups: [default decay, default no-decay, then each extra group split the same way].
    `exclusions=False`: every parameter decays (GOAL's `AdamW(model.parameters(), ...)`), no no-decay groups.

    `extra_groups`: dicts with `params` (tensors of `module`), `lr`, optional `name` and `weight_decay`.
    Each returned group has a `name` (kept in the optimiser state, logged as `lr_<name>`).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    claimed: set[int] = set()
    requested = []
    for i, g in enumerate(extra_groups):
        params = [p for p in g["params"] if p.requires_grad]
        for p in params:
            if id(p) not in names:
                raise ValueError(f"param group {g.get('name', i)!r} holds a parameter that is not in the module")
            if id(p) in claimed:
                raise ValueError(f"a parameter is claimed by two param groups (second: {g.get('name', i)!r})")
            claimed.add(id(p))
        requested.append((g.get("name", f"group{i}"), params, g["lr"], g.get("weight_decay", wd)))
    default = [p for n, p in module.named_parameters() if p.requires_grad and id(p) not in claimed]

    groups = []
    for name, params, group_lr, group_wd in [("default", default, lr, wd)] + requested:
        keep = [p for p in params if exclusions and no_weight_decay(names[id(p)], p)]
        decay = [p for p in params if not (exclusions and no_weight_decay(names[id(p)], p))]
        if decay:
            groups.append({"name": name, "params": decay, "lr": group_lr, "weight_decay": group_wd})
        if keep:
            groups.append({"name": f"{name}_no_decay", "params": keep, "lr": group_lr, "weight_decay": 0.0})
    if not groups:
        raise ValueError("the module has no trainable parameters")
    return groups


def build_optimizer(groups: list[dict], betas=(0.9, 0.98), eps=1e-6) -> torch.optim.AdamW:
    # torch's fused AdamW kernel (CUDA, and CPU since torch 2.4): one pass over each tensor instead of ~10 ops per
    # parameter; the same update up to float rounding, ~8% of the sample-world CPU step. Mixed devices: default loop.
    devices = {p.device.type for g in groups for p in g["params"]}
    fused = len(devices) == 1 and devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(groups, betas=betas, eps=eps, fused=fused or None)


def cosine_with_warmup(step: int, warmup: int, total: int) -> float:
    """LR multiplier of optimiser step `step` (0-based), as open_clip's `cosine_lr`:
    (step + 1) / warmup during warm-up, then 0.5 * (1 + cos(pi * (step - warmup) / (total - warmup)))."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, span) / span))


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-group LR = the group's base LR x `cosine_with_warmup(step)`; call `.step()` after each optimiser step."""
    def factor(step: int) -> float:
        return cosine_with_warmup(step, warmup, total)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
