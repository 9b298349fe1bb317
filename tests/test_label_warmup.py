"""The image tower's label warm-up before contrastive pretraining (`clipfinetune.train.label_warmup`)."""
from __future__ import annotations

import pytest
import torch

from clipfinetune.models import load_model
from clipfinetune.train.label_warmup import label_warmup


def _data(n=32):
    """Half the images bright in the top half, half in the bottom half; labels: ["top", "bottom", "any"] multi-hot."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 64, 64, generator=g) * 0.1
    labels = torch.zeros(n, 3)
    for i in range(n):
        rows = slice(0, 32) if i % 2 else slice(32, 64)
        images[i, :, rows] += 2.0
        labels[i, 0 if i % 2 else 1] = 1.0
        labels[i, 2] = 1.0
    return images, labels


def _run(steps, seed=0):
    torch.manual_seed(0)
    model = load_model("cft-tiny-vit")
    images, labels = _data()
    text_before = {n: p.detach().clone() for n, p in model.clip.named_parameters() if not n.startswith("visual.")}
    curve = label_warmup(model, images, labels, steps=steps, lr=3e-3, batch_size=16, warmup=2, wd=0.1, seed=seed)
    return model, curve, text_before


def test_label_warmup_learns_the_labels_and_trains_only_the_image_tower():
    model, curve, text_before = _run(steps=30)
    assert len(curve) == 30
    # two labels of 1/2 each: the floor is ln 2; a head that tells top from bottom gets near it, chance is higher
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 0.2
    for name, param in model.clip.named_parameters():
        if not name.startswith("visual."):
            assert torch.equal(param, text_before[name]), name


def test_label_warmup_is_a_function_of_its_seed():
    a, _, _ = _run(steps=3, seed=1)
    b, _, _ = _run(steps=3, seed=1)
    c, _, _ = _run(steps=3, seed=2)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.clip.visual.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_label_warmup_draws_only_labelled_images_and_needs_one():
    model = load_model("cft-tiny-vit")
    images, labels = _data(4)
    labels[1:] = 0.0
    images[1:] = float("nan")                 # an unlabelled image in a batch would make the loss NaN
    curve = label_warmup(model, images, labels, steps=2, lr=1e-3, batch_size=4)
    assert all(v == v for v in curve)
    with pytest.raises(ValueError, match="label"):
        label_warmup(model, images, torch.zeros_like(labels), steps=1, lr=1e-3, batch_size=4)
