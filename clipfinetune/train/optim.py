"""AdamW with open_clip's parameter groups, and the cosine schedule with linear warm-up.

open_clip (`open_clip_train/main.py`, docs/methods.md §0.3): parameters with `ndim < 2` or whose name contains
`bn`, `ln`, `bias` or `logit_scale` get no weight decay (`conventions.no_weight_decay`); every other trainable
parameter gets `wd`. The rule is a function, so a caller may pass another (`Method.no_weight_decay`). Extra
groups claim parameters for their own learning rate (`Method.param_groups`); those are split by the same decay
rule. Frozen parameters (`requires_grad=False`, e.g. teachers) are not optimised. Every group carries `log_as`, the name
its learning rate is logged under: `lr` for the default group, `lr_<name>` for an extra one (both halves of a split).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from clipfinetune.conventions import no_weight_decay

DEFAULT = "default"         # the group of every parameter no extra group claims (at `train.lr`)


def parameter_groups(module: nn.Module, lr: float, wd: float, extra_groups: list[dict] = (),
                     no_decay: Callable[[str, torch.Tensor], bool] = no_weight_decay) -> list[dict]:
    """Optimiser groups: [default decay, default no-decay, then each extra group split the same way by
    `no_decay(name, param)`].

    `extra_groups`: dicts with `params` (tensors of `module`), `lr`, optional `name` and `weight_decay`.
    Each returned group has a `name` (kept in the optimiser state) and `log_as` (`lr` or `lr_<name>`).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    claimed: set[int] = set()
    requested = []
    for i, g in enumerate(extra_groups):
        if g.get("name") == DEFAULT:
            raise ValueError(f"param group name {DEFAULT!r} is the trainer's own group (train.lr)")
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
    for name, params, group_lr, group_wd in [(DEFAULT, default, lr, wd)] + requested:
        log_as = "lr" if name == DEFAULT else f"lr_{name}"
        keep = [p for p in params if no_decay(names[id(p)], p)]
        decay = [p for p in params if not no_decay(names[id(p)], p)]
        if decay:
            groups.append({"name": name, "params": decay, "lr": group_lr, "weight_decay": group_wd, "log_as": log_as})
        if keep:
            groups.append({"name": f"{name}_no_decay", "params": keep, "lr": group_lr, "weight_decay": 0.0,
                           "log_as": log_as})
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
