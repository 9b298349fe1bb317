"""Teacher copies (DeGLA's EMA teacher, HarmoCLIP's frozen CLIP) and freezing parts of the student.

Decisions: a teacher is a deep copy in eval mode with every parameter `requires_grad=False`, so it never
joins an optimiser or DDP's gradient reduction and needs no `no_grad` bookkeeping by callers beyond
their own forward. `ema_update` moves parameters only (buffers such as LoRA scalings or kept position
rows are fixed by construction), once per optimiser step: t <- alpha t + (1 - alpha) s (DeGLA,
alpha = 0.9996).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from .towers import text_tower, vision_tower


def frozen_teacher(model: nn.Module) -> nn.Module:
    """A frozen copy of `model` (HarmoCLIP's GR target, DeGLA's frozen variant)."""
    teacher = copy.deepcopy(model)
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def ema_teacher(model: nn.Module) -> nn.Module:
    """A copy to be moved towards the student with `ema_update` after every optimiser step."""
    return frozen_teacher(model)


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, alpha: float) -> None:
    """teacher <- alpha * teacher + (1 - alpha) * student, parameter by parameter (same structure)."""
    student = getattr(student, "module", student)       # a DDP-wrapped student
    teacher_params = dict(teacher.named_parameters())
    student_params = dict(student.named_parameters())
    if teacher_params.keys() != student_params.keys():
        raise ValueError("EMA teacher and student have different parameters")
    targets = [teacher_params[name] for name in teacher_params]
    sources = [student_params[name].detach().to(teacher_params[name].dtype) for name in teacher_params]
    torch._foreach_lerp_(targets, sources, 1.0 - alpha)


def freeze_vision_blocks(model: nn.Module, n: int) -> None:
    """Freeze the stem (patch embedding, CLS/positional embeddings, ln_pre; timm: its "stem" group) and the first
    `n` vision blocks."""
    vision = vision_tower(getattr(model, "clip", model).visual)
    if not 0 <= n <= len(vision.blocks):
        raise ValueError(f"cannot freeze {n} of {len(vision.blocks)} vision blocks")
    if n == 0:
        return
    for block in vision.blocks[:n]:
        block.requires_grad_(False)
    for param in vision.stem_parameters():
        param.requires_grad_(False)


def freeze_tower(model: nn.Module, tower: str) -> None:
    """Freeze the whole `vision` or `text` tower (its projection included)."""
    clip = getattr(model, "clip", model)
    if tower == "vision":
        clip.visual.requires_grad_(False)
    elif tower == "text":
        text = text_tower(clip)
        for part in (text.token_embedding, text.transformer, text.ln_final):
            part.requires_grad_(False)
        for name, param in text.named_parameters():
            if name.startswith(("positional_embedding", "parametrizations.positional_embedding", "text_projection")):
                param.requires_grad_(False)
    else:
        raise ValueError(f"tower must be 'vision' or 'text', got {tower!r}")
