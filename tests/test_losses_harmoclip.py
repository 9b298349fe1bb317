"""HarmoCLIP losses against the float64 per-sample reference (tests/reference/harmoclip_reference.py)."""
import pytest
import torch
import torch.nn.functional as F
from reference import harmoclip_reference as ref

from clipfinetune.losses.harmoclip import HarmoClipLoss

B, L, D = 6, 9, 8


def make_features(seed=0, with_invalid=True):
    g = torch.Generator().manual_seed(seed)
    word_mask = torch.zeros(B, L, dtype=torch.bool)
    for i in range(B):
        start = 1 + i % 4
        word_mask[i, start:start + 1 + i % 3] = True          # 1..3-token words
    valid = torch.ones(B, dtype=torch.bool)
    if with_invalid:
        valid[2] = False
        word_mask[4] = False                                   # an empty word span is invalid too
    return {
        "image": F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_(),
        "text": F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_(),
        "logit_scale": torch.tensor(7.0),
        "text_tokens": torch.randn(B, L, D, generator=g).requires_grad_(),
        "word_mask": word_mask,
        "region": torch.randn(B, D, generator=g).requires_grad_(),
        "region_teacher": torch.randn(B, D, generator=g).requires_grad_(),
        "pair_valid": valid,
        "category": torch.tensor([0, 1, 0, 2, 1, 0]),
    }


def reference_valid(f):
    return f["pair_valid"] & f["word_mask"].any(1)


def test_global_contrastive_matches_reference():
    f = make_features()
    out = HarmoClipLoss()(f)
    expected = ref.gc_loss(f["image"].detach(), f["text"].detach(), 7.0)
    assert out["contrastive"].item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("with_invalid", [False, True])
def test_lexeme_region_contrastive_matches_reference(with_invalid):
    f = make_features(with_invalid=with_invalid)
    out = HarmoClipLoss(lambda_lrc=0.7)(f)
    expected = ref.lrc_loss(f["region"].detach(), f["text_tokens"].detach(), f["word_mask"], 7.0,
                            reference_valid(f))
    assert out["lexeme_region"].item() == pytest.approx(0.7 * expected, rel=1e-5)


def test_same_category_masking_matches_reference():
    f = make_features()
    out = HarmoClipLoss(mask_same_category=True)(f)
    expected = ref.lrc_loss(f["region"].detach(), f["text_tokens"].detach(), f["word_mask"], 7.0,
                            reference_valid(f), category=f["category"])
    assert out["lexeme_region"].item() == pytest.approx(expected, rel=1e-5)
    unmasked = HarmoClipLoss()(f)["lexeme_region"].item()
    assert out["lexeme_region"].item() != pytest.approx(unmasked, rel=1e-4)


def test_same_category_masking_removes_exactly_those_pairs():
    # one same-category pair, (0, 1): masking removes (0,1) and (1,0) from the softmaxes and nothing else
    f = make_features(with_invalid=False)
    f["category"] = torch.tensor([3, 3, 4, 5, 6, 7])
    masked = HarmoClipLoss(mask_same_category=True)(f)["lexeme_region"].item()
    expected = ref.lrc_loss(f["region"].detach(), f["text_tokens"].detach(), f["word_mask"], 7.0,
                            reference_valid(f), category=f["category"])
    unmasked = HarmoClipLoss()(f)["lexeme_region"].item()
    assert masked == pytest.approx(expected, rel=1e-5)
    assert masked != pytest.approx(unmasked, rel=1e-4)
    # all categories distinct: nothing is removed, the masked loss is eq. (7) as written
    distinct = HarmoClipLoss(mask_same_category=True)(dict(f, category=torch.arange(B)))["lexeme_region"].item()
    assert distinct == pytest.approx(unmasked, rel=1e-6)


def test_invalid_pairs_are_neither_rows_nor_columns():
    f = make_features()
    base = HarmoClipLoss()(f)
    g = dict(f)
    g["region"] = f["region"].detach().clone()
    g["region"][2] = 1e3                                       # pair 2 is invalid
    g["text_tokens"] = f["text_tokens"].detach().clone()
    g["text_tokens"][2] = float("nan")                         # even a NaN placeholder does not leak
    g["region_teacher"] = f["region_teacher"].detach().clone()
    g["region_teacher"][2] = -5.0
    out = HarmoClipLoss()(g)
    assert out["lexeme_region"].item() == pytest.approx(base["lexeme_region"].item(), rel=1e-6)
    assert out["global_region"].item() == pytest.approx(base["global_region"].item(), rel=1e-6)


def test_global_region_alignment_matches_reference():
    f = make_features()
    out = HarmoClipLoss(lambda_gr=2.0)(f)
    expected = ref.gr_loss(f["region"].detach(), f["region_teacher"].detach(), f["pair_valid"] & f["word_mask"].any(1))
    assert out["global_region"].item() == pytest.approx(2.0 * expected, rel=1e-5)


def test_gradients_are_finite_and_teacher_gets_none():
    f = make_features()
    loss_fn = HarmoClipLoss(mask_same_category=True)
    out = loss_fn(f)
    sum(out.values()).backward()
    for key in ("image", "text", "text_tokens", "region"):
        assert f[key].grad is not None and torch.isfinite(f[key].grad).all(), key
    assert f["region_teacher"].grad is None
    assert f["region"].grad[2].abs().sum() == 0                 # invalid pair gets no gradient
    assert loss_fn.stats == {"n_pairs": 4, "n_without_pair": 2}


def test_no_valid_pair_gives_zero_finite_terms():
    f = make_features()
    f["pair_valid"] = torch.zeros(B, dtype=torch.bool)
    out = HarmoClipLoss()(f)
    assert out["lexeme_region"].item() == 0.0 and out["global_region"].item() == 0.0
    sum(out.values()).backward()
    assert torch.isfinite(f["region"].grad).all()


def test_zero_weights_need_no_region_inputs():
    f = make_features()
    global_only = {k: f[k] for k in ("image", "text", "logit_scale")}
    out = HarmoClipLoss(lambda_lrc=0.0, lambda_gr=0.0)(global_only)
    assert out["lexeme_region"].item() == 0.0 and out["global_region"].item() == 0.0
    assert out["contrastive"].item() == pytest.approx(HarmoClipLoss()(f)["contrastive"].item(), rel=1e-6)
