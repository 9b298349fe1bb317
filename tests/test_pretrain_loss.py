"""The pretraining region-text term against the float64 per-sample reference (tests/reference/pretrain_reference.py)."""
import pytest
import torch
import torch.nn.functional as F
from reference import pretrain_reference as ref

from clipfinetune.sample.pretrain.loss import PretrainLoss, region_text_loss

K, D = 7, 8


def make_features(seed=0):
    g = torch.Generator().manual_seed(seed)
    classes = torch.tensor([4, 1, 4, 9, 1, 4, 2])               # ids need not be contiguous
    names = {c: F.normalize(torch.randn(D, generator=g), dim=0) for c in (1, 2, 4, 9)}
    return {
        "image": F.normalize(torch.randn(5, D, generator=g), dim=-1),
        "text": F.normalize(torch.randn(5, D, generator=g), dim=-1),
        "logit_scale": torch.tensor(6.0),
        "region": F.normalize(torch.randn(K, D, generator=g), dim=-1),
        "region_text": torch.stack([names[int(c)] for c in classes]),   # rows of one name are equal
        "region_class": classes,
    }, names


def test_region_text_term_matches_reference():
    f, names = make_features()
    got = region_text_loss(f["region"], f["region_text"], f["region_class"], f["logit_scale"])
    want = ref.rt_loss(f["region"], names, f["region_class"], 6.0)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_each_name_counts_once_in_the_denominator():
    """Three regions of one name: its embedding enters each softmax once, not three times."""
    f, names = make_features()
    loss = region_text_loss(f["region"], f["region_text"], f["region_class"], f["logit_scale"])
    dup = torch.cat([f["region_text"], f["region_text"][:1].expand(3, -1)])      # more rows of name 4
    regions = torch.cat([f["region"], f["region"][:3]])
    classes = torch.cat([f["region_class"], torch.tensor([4, 4, 4])])
    want = ref.rt_loss(regions, names, classes, 6.0)
    assert float(region_text_loss(regions, dup, classes, f["logit_scale"])) == pytest.approx(want, rel=1e-5)
    assert float(loss) != pytest.approx(want, rel=1e-3)          # the extra regions do change the mean


def test_pretrain_loss_weights_the_term_and_drops_it_at_zero():
    f, names = make_features()
    terms = PretrainLoss(0.5)(f)
    assert set(terms) == {"contrastive", "region_text"}
    assert float(terms["region_text"]) == pytest.approx(0.5 * ref.rt_loss(f["region"], names, f["region_class"], 6.0),
                                                        rel=1e-5)
    assert set(PretrainLoss(0.0)({k: f[k] for k in ("image", "text", "logit_scale")})) == {"contrastive"}
