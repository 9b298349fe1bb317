"""GOAL losses against the float64 per-sample reference (tests/reference/goal_reference.py)."""
import pytest
import torch
import torch.nn.functional as F
from reference import goal_reference as ref

from clipfinetune.losses.goal import GoalLoss

B, D = 7, 8
SCALE = 6.0


def make_features(seed=0):
    g = torch.Generator().manual_seed(seed)

    def emb():
        return F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_()

    return {
        "image": emb(), "text": emb(), "logit_scale": torch.tensor(SCALE),
        "local_image": emb(), "local_text": emb(),
        "local_valid": torch.tensor([1, 1, 0, 1, 1, 0, 1], dtype=torch.bool),
        "region_pooled": emb(), "sentence_pooled": emb(),
        "span_valid": torch.tensor([1, 0, 1, 1, 1, 1, 1], dtype=torch.bool),
    }


def rows(mask):
    return [i for i in range(B) if bool(mask[i])]


def detached(f, k):
    return f[k].detach()


def test_global_matches_reference():
    f = make_features()
    out = GoalLoss(lambda_global=1.5)(f)
    assert out["contrastive"].item() == pytest.approx(
        1.5 * ref.contrast(detached(f, "image"), detached(f, "text"), SCALE, list(range(B))), rel=1e-5)


def test_local_matches_reference_over_pairs_only():
    f = make_features()
    out = GoalLoss()(f)                                         # lambda_local = 0.5 by default
    expected = ref.contrast(detached(f, "local_image"), detached(f, "local_text"), SCALE, rows(f["local_valid"]))
    assert out["local_contrastive"].item() == pytest.approx(0.5 * expected, rel=1e-5)


@pytest.mark.parametrize("mode", ["diag", "identity"])
def test_tsl_matches_reference(mode):
    f = make_features()
    out = GoalLoss(lambda_tsl=2.0, tsl_target=mode)(f)
    image_rows = rows(f["local_valid"])
    text_rows = rows(f["local_valid"] & f["span_valid"])
    assert out["tsl_image"].item() == pytest.approx(
        2.0 * ref.tsl_side(detached(f, "region_pooled"), detached(f, "local_image"), image_rows, mode), rel=1e-5)
    assert out["tsl_text"].item() == pytest.approx(
        2.0 * ref.tsl_side(detached(f, "sentence_pooled"), detached(f, "local_text"), text_rows, mode), rel=1e-5)


def test_tsl_modes_differ():
    f = make_features()
    diag = GoalLoss(tsl_target="diag")(f)["tsl_image"].item()
    ident = GoalLoss(tsl_target="identity")(f)["tsl_image"].item()
    assert diag != pytest.approx(ident, rel=1e-3)
    with pytest.raises(ValueError):
        GoalLoss(tsl_target="full")


def test_masked_rows_are_excluded():
    f = make_features()
    base = GoalLoss(tsl_target="identity")(f)
    g = dict(f)
    for key in ("local_image", "local_text", "region_pooled", "sentence_pooled"):
        g[key] = f[key].detach().clone()
        g[key][[2, 5]] = float("nan")                           # rows without a local pair
    g["sentence_pooled"][1] = 3.0                               # truncated sentence span
    out = GoalLoss(tsl_target="identity")(g)
    for term in ("local_contrastive", "tsl_image", "tsl_text"):
        assert out[term].item() == pytest.approx(base[term].item(), rel=1e-6), term


def test_counts_are_reported_outside_the_terms():
    f = make_features()
    loss_fn = GoalLoss()
    out = loss_fn(f)
    assert set(out) == {"contrastive", "local_contrastive", "tsl_image", "tsl_text"}
    assert all(isinstance(v, torch.Tensor) and v.requires_grad for v in out.values())
    assert loss_fn.stats == {"n_local": 5, "n_global_only": 2, "n_tsl_text_dropped": 1}


@pytest.mark.parametrize("mode", ["diag", "identity"])
def test_gradients_are_finite_and_targets_not_detached(mode):
    f = make_features()
    out = GoalLoss(tsl_target=mode)(f)
    sum(out.values()).backward()
    for key in ("image", "text", "local_image", "local_text", "region_pooled", "sentence_pooled"):
        assert torch.isfinite(f[key].grad).all(), key
    # the crop / sentence targets receive gradient from TSL (not detached, as in the authors' code)
    f2 = make_features()
    GoalLoss(tsl_target=mode)(f2)["tsl_image"].backward()
    assert f2["local_image"].grad[0].abs().sum() > 0
    assert f2["local_image"].grad[2].abs().sum() == 0           # no local pair, no gradient
    f3 = make_features()
    GoalLoss(tsl_target=mode)(f3)["tsl_text"].backward()
    assert f3["local_text"].grad[1].abs().sum() == 0            # truncated span dropped from TSL


def test_no_local_pair_in_batch_gives_zero_local_terms():
    f = make_features()
    f["local_valid"] = torch.zeros(B, dtype=torch.bool)
    out = GoalLoss()(f)
    assert out["local_contrastive"].item() == 0.0 and out["tsl_image"].item() == 0.0 and out["tsl_text"].item() == 0.0
    sum(out.values()).backward()
    assert torch.isfinite(f["image"].grad).all()


def test_global_only_ablation_needs_no_local_inputs():
    f = make_features()
    out = GoalLoss(lambda_local=0.0, lambda_tsl=0.0)({k: f[k] for k in ("image", "text", "logit_scale")})
    assert out["local_contrastive"].item() == 0.0 and out["tsl_image"].item() == 0.0
    assert out["contrastive"].item() == pytest.approx(GoalLoss()(f)["contrastive"].item(), rel=1e-6)
    sum(out.values()).backward()
    assert torch.isfinite(f["image"].grad).all()
