"""FSC-CLIP loss terms against the float64 per-sample reference written from the paper (tests/reference)."""
import pytest
import torch
import torch.nn.functional as F
from fixtures.losses import assert_value_and_grads_match, with_grad
from reference import fsc_clip_reference as ref

from clipfinetune.losses.fsc_clip import (
    FscClipLoss,
    global_hn_loss,
    local_hn_loss,
    patch_attention_weights,
    selective_calibrated_loss,
)

B, K, P, L, D = 4, 3, 5, 6, 8
GAMMA, BETA = 2.0, 0.02


def make_features(seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    neg_valid = torch.ones(b, K, dtype=torch.bool)
    neg_valid[0, 1] = False                      # one missing negative
    neg_valid[2] = False                         # a row without any negative
    if b > 3:
        neg_valid[3, 0] = neg_valid[3, 2] = False
    token_mask = torch.rand(b, 1 + K, L, generator=g) > 0.4
    token_mask[..., 0] = False                   # SOT dropped
    token_mask[..., 2] = True                    # every text keeps at least its "EOT"
    return {
        "image": F.normalize(rnd(b, D), dim=-1),
        "text": F.normalize(rnd(b, D), dim=-1),
        "neg_text": F.normalize(rnd(b, K, D), dim=-1),
        "neg_valid": neg_valid,
        "patches": rnd(b, P, D) * 2,
        "text_tokens": rnd(b, 1 + K, L, D) * 2,
        "text_mask": token_mask,
        "logit_scale": torch.tensor(4.0, dtype=torch.float64),
    }


def module_global(f, gamma=GAMMA, beta=BETA):
    return global_hn_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"], f["logit_scale"], gamma, beta)


def module_local(f, weighting="minmax", gamma=GAMMA, beta=BETA):
    return local_hn_loss(f["patches"], f["text_tokens"], f["text_mask"], f["neg_valid"], f["logit_scale"],
                         gamma, beta, weighting)


def ref_global(f, gamma=GAMMA, beta=BETA):
    return ref.global_hn_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"], f["logit_scale"], gamma, beta)


def ref_local(f, weighting="minmax", gamma=GAMMA, beta=BETA, detach_weights=True):
    return ref.local_hn_loss(f["patches"], f["text_tokens"], f["text_mask"], f["neg_valid"], f["logit_scale"],
                             gamma, beta, weighting, detach_weights)


def test_global_hn_loss_matches_reference_values_and_gradients():
    f = make_features(0)
    fm = assert_value_and_grads_match(module_global, ref_global, f, ["image", "text", "neg_text", "logit_scale"])
    assert fm["neg_text"].grad[2].abs().max() == 0            # the dropped row gets no gradient


@pytest.mark.parametrize("weighting", ["minmax", "sparse", "softmax"])
def test_local_hn_loss_matches_reference_values_and_gradients(weighting):
    f = make_features(1)
    assert_value_and_grads_match(lambda x: module_local(x, weighting), lambda x: ref_local(x, weighting), f,
                                 ["patches", "text_tokens", "logit_scale"])


def test_module_returns_weighted_terms_eq_11():
    f = make_features(2)
    loss = FscClipLoss(lambda_g=0.3, lambda_l=0.7, focal_gamma=GAMMA, label_smoothing=BETA)
    terms = loss(f)
    assert set(terms) == {"contrastive", "global_hn", "local_hn"}
    torch.testing.assert_close(terms["contrastive"], ref.clip_loss(f["image"], f["text"], f["logit_scale"]))
    torch.testing.assert_close(terms["global_hn"], 0.3 * ref_global(f))
    torch.testing.assert_close(terms["local_hn"], 0.7 * ref_local(f))


def test_contrastive_term_ignores_hard_negatives():
    f = make_features(3)
    g = dict(f, neg_text=torch.randn(B, K, D, dtype=torch.float64), neg_valid=torch.ones(B, K, dtype=torch.bool))
    loss = FscClipLoss()
    torch.testing.assert_close(loss(f)["contrastive"], loss(g)["contrastive"])


def test_missing_negative_is_masked_not_a_zero_logit():
    f = make_features(4)
    # the invalid negative's features (global and tokens) do not matter at all
    g = {k: v.clone() for k, v in f.items()}
    g["neg_text"][0, 1] = F.normalize(torch.randn(D, dtype=torch.float64), dim=0)
    g["text_tokens"][0, 2] = torch.randn(L, D, dtype=torch.float64) * 5
    torch.testing.assert_close(module_global(f), module_global(g), rtol=0, atol=0)
    torch.testing.assert_close(module_local(f), module_local(g), rtol=0, atol=0)
    # it is as if the negative were absent: row 0 alone equals row 0 with that column removed
    keep = [0, 2]
    one = {k: v[:1] for k, v in f.items() if k != "logit_scale"} | {"logit_scale": f["logit_scale"]}
    removed = dict(one, neg_text=one["neg_text"][:, keep], neg_valid=one["neg_valid"][:, keep],
                   text_tokens=one["text_tokens"][:, [0, 1, 3]], text_mask=one["text_mask"][:, [0, 1, 3]])
    torch.testing.assert_close(module_global(one), module_global(removed))
    torch.testing.assert_close(module_local(one), module_local(removed))
    # ... and not the authors' zero vector with logit 0 (docs/methods.md §6.2), which changes the softmax
    zero_vec = dict(one, neg_text=one["neg_text"].clone(), neg_valid=torch.ones(1, K, dtype=torch.bool))
    zero_vec["neg_text"][0, 1] = 0.0
    assert not torch.allclose(module_global(one), module_global(zero_vec))


def test_negative_without_tokens_counts_as_missing():
    f = make_features(5)
    g = dict(f, text_mask=f["text_mask"].clone(), neg_valid=f["neg_valid"].clone())
    g["text_mask"][1, 3] = False                       # negative 2 of sample 1 has no token
    h = dict(f, neg_valid=f["neg_valid"].clone())
    h["neg_valid"][1, 2] = False
    torch.testing.assert_close(module_local(g), module_local(h))
    fg = with_grad(g)
    module_local(fg).backward()
    assert torch.isfinite(fg["text_tokens"].grad).all() and torch.isfinite(fg["patches"].grad).all()


def test_rows_without_negatives_are_dropped():
    f = make_features(6)
    rows = [0, 1, 3]                                    # row 2 has no valid negative
    sub = {k: v[rows] for k, v in f.items() if k != "logit_scale"} | {"logit_scale": f["logit_scale"]}
    torch.testing.assert_close(module_global(f), module_global(sub))
    torch.testing.assert_close(module_local(f), module_local(sub))


def test_batch_without_any_negative_gives_zero_with_finite_gradient():
    f = with_grad(make_features(7))
    f["neg_valid"] = torch.zeros(B, K, dtype=torch.bool)
    terms = FscClipLoss()(f)
    assert terms["global_hn"].item() == 0 and terms["local_hn"].item() == 0
    assert terms["global_hn"].requires_grad and terms["local_hn"].requires_grad
    sum(terms.values()).backward()
    for k in ["image", "text", "neg_text", "patches", "text_tokens", "logit_scale"]:
        assert f[k].grad is not None and torch.isfinite(f[k].grad).all(), k
    assert f["patches"].grad.abs().max() == 0           # only the contrastive term moves anything


def test_scr_is_plain_cross_entropy_at_gamma_0_beta_0():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 1 + K, generator=g, dtype=torch.float64) * 3
    valid = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    expected = torch.stack([F.cross_entropy(logits[i, [0] + [1 + k for k in range(K) if valid[i, k]]][None],
                                            torch.tensor([0])) for i in range(5) if valid[i].any()]).mean()
    torch.testing.assert_close(selective_calibrated_loss(logits, valid, 0.0, 0.0), expected)
    # and SCR with its defaults is a different loss (the test above can fail)
    assert not torch.allclose(selective_calibrated_loss(logits, valid, GAMMA, BETA), expected)


def test_scr_label_mass_goes_to_valid_negatives_only():
    logits = torch.zeros(1, 1 + K, dtype=torch.float64, requires_grad=True)
    valid = torch.tensor([[True, False, True]])
    loss = selective_calibrated_loss(logits, valid, 0.0, 0.3)
    # gamma = 0: gradient of soft-target CE is p - y; p uniform over 3 valid candidates, y = (0.8, 0.1, -, 0.1)
    loss.backward()
    expected = torch.tensor([[1 / 3 - 0.8, 1 / 3 - 0.1, 0.0, 1 / 3 - 0.1]], dtype=torch.float64)
    torch.testing.assert_close(logits.grad, expected)


def test_constant_similarity_row_gives_uniform_weights_and_no_nan():
    f = with_grad(make_features(9))
    with torch.no_grad():
        f["patches"][:] = f["patches"][:, :1]             # all patches equal: s_{w,.} constant for every token
    for weighting in ["minmax", "sparse", "softmax"]:
        a = patch_attention_weights(torch.full((2, P), 3.0), weighting)
        torch.testing.assert_close(a, torch.full((2, P), 1.0 / P))
    loss = module_local(f)
    torch.testing.assert_close(loss, ref_local(make_features(9) | {"patches": f["patches"].detach()}))
    loss.backward()
    assert torch.isfinite(f["patches"].grad).all() and torch.isfinite(f["text_tokens"].grad).all()


def test_attention_weights_carry_no_gradient():
    f = make_features(10)
    fm, f_detached, f_live = with_grad(f), with_grad(f), with_grad(f)
    module_local(fm).backward()
    ref_local(f_detached, detach_weights=True).backward()
    ref_local(f_live, detach_weights=False).backward()
    torch.testing.assert_close(fm["patches"].grad, f_detached["patches"].grad)
    torch.testing.assert_close(fm["text_tokens"].grad, f_detached["text_tokens"].grad)
    # differentiating through eq. (6)-(7) would give another gradient, so the check above is meaningful
    assert not torch.allclose(fm["text_tokens"].grad, f_live["text_tokens"].grad)


def test_all_gradients_finite_in_float32():
    f = with_grad({k: (v.float() if v.is_floating_point() else v) for k, v in make_features(11).items()})
    f["logit_scale"] = torch.tensor(100.0, requires_grad=True)
    terms = FscClipLoss()(f)
    sum(terms.values()).backward()
    for k in ["image", "text", "neg_text", "patches", "text_tokens", "logit_scale"]:
        assert torch.isfinite(f[k].grad).all(), k
    assert all(torch.isfinite(v) for v in terms.values())


def test_zero_weight_skips_the_term_and_its_inputs():
    f = make_features(12)
    terms = FscClipLoss(lambda_l=0.0)({k: v for k, v in f.items() if k not in ("patches", "text_tokens", "text_mask")})
    assert terms["local_hn"].item() == 0
    with pytest.raises(ValueError):
        FscClipLoss(lhn_weighting="max")
