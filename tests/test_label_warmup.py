"""The image tower's label warm-up before contrastive pretraining (`clipfinetune.sample.pretrain.label_warmup`), run
by the one Trainer: the loss curve is what the Trainer hands its monitor."""
from __future__ import annotations

import math

import pytest
import torch

from clipfinetune.models import load_model
from clipfinetune.sample.pretrain.label_warmup import label_warmup as objective
from clipfinetune.train import NonFiniteLossError, TrainConfig, Trainer


class Curve(list):
    """A monitor that keeps every step's total loss."""

    def log(self, step: int, scalars: dict) -> None:
        self.append(scalars["loss"])


def label_warmup(model, images, labels, *, steps, lr, batch_size, warmup=0, wd=0.0, seed=0, regions=None,
                 precision="fp32") -> list[float]:
    """The stage's warm-up on one rank: the objective and its batches through the Trainer; its loss curve."""
    method, batches = objective(images, labels, embed_dim=model.embed_dim, steps=steps, batch_size=batch_size, lr=lr,
                                seed=seed, regions=regions)
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=lr, warmup=warmup, wd=wd, seed=seed, precision=precision)
    curve = Curve()
    method.final_model(Trainer(method, model, batches, cfg).fit(curve), model)
    return curve


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
    assert all(p.requires_grad for p in model.parameters())      # frozen for the warm-up, trainable again after


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
    assert len(curve) == 2 and not any(math.isnan(v) for v in curve)
    with pytest.raises(ValueError, match="label"):
        objective(images, torch.zeros_like(labels), embed_dim=8, steps=1, batch_size=4, lr=1e-3)


def _two_object_data(n=48):
    """Each image: two noisy cells (left, right), each holding a horizontal bar, a vertical bar or a cross of the same
    brightness; region labels = the kind in each cell, image labels (the kinds present) on a third of the images."""
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, 64, 64, generator=g) * 0.3
    labels, regions = torch.zeros(n, 3), []
    boxes = torch.tensor([[4.0, 20.0, 28.0, 44.0], [36.0, 20.0, 60.0, 44.0]])
    for i in range(n):
        rows = torch.zeros(2, 3)
        for k, (kind, (x0, y0, x1, y1)) in enumerate(zip(torch.randint(3, (2,), generator=g).tolist(),
                                                         boxes.int().tolist())):
            cx, cy = (x0 + x1) // 2, (y0 + y1) // 2
            if kind in (0, 2):
                images[i, :, cy - 2:cy + 2, x0 + 2 + 4 * (kind == 2):x1 - 2 - 4 * (kind == 2)] += 2.0
            if kind in (1, 2):
                images[i, :, y0 + 2 + 4 * (kind == 2):y1 - 2 - 4 * (kind == 2), cx - 2:cx + 2] += 2.0
            rows[k, kind] = 1.0
        if i % 3 == 0:
            labels[i] = rows.amax(0)
        regions.append((boxes.clone(), rows))
    return images, labels, regions


def _region_accuracy(model, images, regions):
    """Nearest class centroid of the region features (leave nothing out: a separation measure, not a benchmark)."""
    with torch.no_grad():
        feats = model.region_features(images, [b for b, _ in regions])
    target = torch.cat([r for _, r in regions]).argmax(1)
    centroids = torch.stack([feats[target == c].mean(0) for c in range(3)])
    return float(((feats @ centroids.T).argmax(1) == target).float().mean())


def test_label_warmup_region_term_teaches_the_dense_features_what_sits_in_each_box():
    images, labels, regions = _two_object_data()
    accuracy = {}
    for use_regions in (False, True):
        torch.manual_seed(0)
        model = load_model("cft-tiny-vit")
        curve = label_warmup(model, images, labels, steps=40, lr=3e-3, batch_size=16, warmup=2, wd=0.1,
                             regions=regions if use_regions else None)
        assert len(curve) == 40
        accuracy[use_regions] = _region_accuracy(model, images, regions)
    # Random features tell these patterns apart; training the pooled embedding alone (the image term) then mixes the
    # dense features of the cells (measured 0.46), while the region term keeps each cell's kind readable (0.89).
    assert accuracy[True] >= 0.8 and accuracy[True] > accuracy[False] + 0.2, accuracy


def test_label_warmup_with_regions_draws_unlabelled_images_too():
    images, labels, regions = _two_object_data(6)
    labels[:] = 0.0
    labels[0, 0] = 1.0                                        # one labelled image; the region term uses all six
    images[1:] = float("nan")                                 # a drawn unlabelled image makes the loss NaN
    model = load_model("cft-tiny-vit")
    curve = label_warmup(model, images, labels, steps=2, lr=1e-3, batch_size=6)
    assert len(curve) == 2 and not any(math.isnan(v) for v in curve)
    with pytest.raises(NonFiniteLossError, match="region_labels"):      # the Trainer's guard names the term
        label_warmup(load_model("cft-tiny-vit"), images, labels, steps=1, lr=1e-3, batch_size=6, regions=regions)
    with pytest.raises(ValueError, match="region"):
        objective(images, labels, embed_dim=8, steps=1, batch_size=6, lr=1e-3, regions=regions[:2])


def test_label_batches_resume_at_any_step_and_split_each_global_batch_over_the_ranks():
    images, labels, regions = _two_object_data(12)
    whole = objective(images, labels, embed_dim=8, steps=5, batch_size=8, lr=1e-3, seed=3, regions=regions)[1]
    ranks = [objective(images, labels, embed_dim=8, steps=5, batch_size=8, lr=1e-3, seed=3, regions=regions, rank=r,
                       world_size=2)[1] for r in (0, 1)]
    full = list(whole.batches(0))
    assert len(whole) == len(full) == 5
    for got, want in zip(whole.batches(0, start=3), full[3:]):          # a resumed epoch: the same draws
        assert all(torch.equal(got[k], want[k]) for k in want)
    for step, (a, b) in enumerate(zip(*(r.batches(0) for r in ranks))):
        assert torch.equal(torch.cat([a["image"], b["image"]]), full[step]["image"])
        assert torch.equal(torch.cat([a["region_labels"], b["region_labels"]]), full[step]["region_labels"])
        assert a["region_boxes"][:, 0].max() < 4 and b["region_boxes"][:, 0].max() < 4    # rows of its own slice
