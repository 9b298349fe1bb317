"""The label warm-up in bf16 (`pretrain` with `model.precision: bf16`): the image tower's forward runs under CPU
autocast, the weights stay float32, and the loss still falls over 30 steps. About a minute on 2 cores (bf16 matmuls
on the CPU), so here rather than in tests/test_label_warmup.py."""
from __future__ import annotations

import torch
from test_label_warmup import _data, label_warmup

from clipfinetune.models import load_model


def test_label_warmup_in_bf16_runs_the_forward_under_autocast_and_still_learns(tmp_path):
    seen = []
    torch.manual_seed(0)
    model = load_model("cft-tiny-vit")
    encode = model.encode_image

    def spy(*args, **kwargs):
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return encode(*args, **kwargs)
    model.encode_image = spy
    images, labels = _data()
    curve = label_warmup(model, images, labels, steps=30, lr=3e-3, batch_size=16, warmup=2, wd=0.1, precision="bf16")
    assert seen == [(True, torch.bfloat16)] * 30
    assert all(p.dtype == torch.float32 for p in model.clip.visual.parameters())     # autocast, not a cast model
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.2
