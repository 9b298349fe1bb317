"""open_clip's training conventions (`open_clip_train/main.py`, `train.py`; docs/methods.md §0.3), in one place below
the trainer and the methods: the methods' hooks default to them (`methods/base.py`) and the optimiser groups apply
the decay rule (`train/optim.py`), so a method's code never imports the training loop."""
from __future__ import annotations

import math

import torch

MAX_LOGIT_SCALE = math.log(100)        # the logit scale is clamped to [0, ln 100] after every step


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """The exclusion rule: norms, biases, gains, embeddings of ndim < 2, and the logit scale get no weight decay."""
    return param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
