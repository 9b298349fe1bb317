"""MulCLIP losses against the float64 per-sample reference (tests/reference/mulclip_reference.py)."""
import math

import pytest
import torch
import torch.nn.functional as F
from reference import mulclip_reference as ref

from clipfinetune.losses.mulclip import MulClipLoss
from clipfinetune.losses.mulclip_modules import TokenCalibration

B, P, L, D, S = 4, 6, 8, 8, 3
LENGTHS = [6, 3, 7, 4]                                   # valid tokens incl. EOT (SOT at 0 is masked)


def make_features(seed=0, short=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b, n in enumerate(LENGTHS):
        mask[b, 1:1 + n] = True
    sub_valid = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    f = {
        "image": F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_(),
        "text": F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_(),
        "patches": torch.randn(B, P, D, generator=g).requires_grad_(),
        "text_tokens": torch.randn(B, L, D, generator=g).requires_grad_(),
        "text_mask": mask,
        "sub_text": F.normalize(torch.randn(B, S, D, generator=g), dim=-1).requires_grad_(),
        "sub_valid": sub_valid,
    }
    if short:
        f["text_short"] = F.normalize(torch.randn(B, D, generator=g), dim=-1).requires_grad_()
    return f


def make_loss(**kw):
    torch.manual_seed(1)
    loss = MulClipLoss(embed_dim=D, n_patches=P, context_length=L, **kw)
    with torch.no_grad():                                 # move heads off the init so the test is not special
        for head in loss.heads.values():
            head.logit_scale.fill_(math.log(3.0))
            if head.logit_bias is not None:
                head.logit_bias.fill_(-1.5)
    return loss


def ref_calibrated(loss, f, samples=range(B)):
    """v', t' of the samples from the reference eq. (4) with the module's own parameters."""
    pc, tc = loss.patch_calibration, loss.text_calibration
    v, t = {}, {}
    for b in samples:
        v[b] = ref.calibrate(f["patches"][b].detach(), [True] * P, pc.key.weight.detach().T,
                             pc.query.detach(), float(pc.log_tau.detach().exp()))
        local = [bool(m) for m in f["text_mask"][b]]
        local[max(i for i, m in enumerate(local) if m)] = False            # EOT is t_eot, not local
        t[b] = ref.calibrate(f["text_tokens"][b].detach(), local, tc.key.weight.detach().T,
                             tc.query.detach(), float(tc.log_tau.detach().exp()))
    return v, t


def rows(x):
    return [ref._vec(r) for r in x.detach()]


def test_calibration_shape_and_values_match_reference():
    torch.manual_seed(0)
    calib = TokenCalibration(n_tokens=L, dim=D, ratio=0.5)
    with torch.no_grad():
        calib.log_tau.fill_(math.log(0.7))
    x = torch.randn(B, L, D)
    mask = make_features()["text_mask"]
    out = calib(x, mask)
    assert out.shape == (B, 4, D) and calib.key_dim == D // 2
    assert TokenCalibration(n_tokens=7, dim=D, ratio=0.5).n_out == 4   # round(3.5) -> 4
    assert TokenCalibration(n_tokens=196, dim=D, ratio=0.5).n_out == 98
    for b in range(B):
        expected = ref.calibrate(x[b], [bool(m) for m in mask[b]], calib.key.weight.detach().T,
                                 calib.query.detach(), 0.7)
        assert torch.allclose(out[b].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5)


def test_padded_tokens_change_nothing():
    loss = make_loss()
    f = make_features()
    base = loss(f)
    g = dict(f, text_tokens=f["text_tokens"].detach().clone())
    g["text_tokens"][~f["text_mask"]] = 1e4                   # SOT and padding positions
    _, t1, _ = loss.calibrate(f["patches"], f["text_tokens"], f["text_mask"])
    _, t2, _ = loss.calibrate(g["patches"], g["text_tokens"], g["text_mask"])
    assert torch.equal(t1, t2)
    out = loss(g)
    for k in base:
        assert out[k].item() == pytest.approx(base[k].item(), rel=1e-6), k


def test_global_sigmoid_matches_reference():
    loss = make_loss(lambda_short=0.5)
    f = make_features()
    out = loss(f)
    assert out["contrastive"].item() == pytest.approx(
        ref.batch_sigmoid(rows(f["image"]), rows(f["text"]), 3.0, -1.5), rel=1e-5)
    assert out["contrastive_short"].item() == pytest.approx(
        0.5 * ref.batch_sigmoid(rows(f["image"]), rows(f["text_short"]), 3.0, -1.5), rel=1e-5)


def test_summary_defaults_to_first_subcaption_masked():
    loss = make_loss(lambda_short=0.5)
    f = make_features(short=False)
    out = loss(f)
    valid0 = [bool(v) for v in f["sub_valid"][:, 0]]          # image 3 has no sentence 0
    expected = ref.batch_sigmoid(rows(f["image"]), rows(f["sub_text"][:, 0]), 3.0, -1.5, valid0)
    assert out["contrastive_short"].item() == pytest.approx(0.5 * expected, rel=1e-5)


def test_softmax_option_matches_reference():
    loss = make_loss(contrast="softmax")
    f = make_features()
    out = loss(f)
    assert loss.heads["global"].logit_bias is None
    assert out["contrastive"].item() == pytest.approx(
        ref.batch_softmax(rows(f["image"]), rows(f["text"]), 3.0), rel=1e-5)


def test_word_patch_reconstruction_matches_reference():
    loss = make_loss(lambda_word=0.8)
    f = make_features()
    out = loss(f)
    v, t = ref_calibrated(loss, f)
    expected = sum(ref.wpr_sample(v[b], t[b], 3.0, -1.5) for b in range(B)) / B
    assert out["word_patch"].item() == pytest.approx(0.8 * expected, rel=1e-5)


def test_word_patch_reconstruction_uses_no_other_sample():
    loss = make_loss()
    f = make_features()

    def grad_of_sample0(features):
        p = features["patches"].detach().clone().requires_grad_()
        tok = features["text_tokens"].detach().clone().requires_grad_()
        loss(dict(features, patches=p, text_tokens=tok))["word_patch"].backward()
        return p.grad[0].clone(), tok.grad[0].clone(), p.grad[2].clone()

    before = grad_of_sample0(f)
    g = dict(f, patches=f["patches"].detach().clone(), text_tokens=f["text_tokens"].detach().clone())
    g["patches"][2] += 5.0 * torch.randn(P, D)                # perturb sample 2 only
    g["text_tokens"][2] -= 3.0
    after = grad_of_sample0(g)
    assert torch.allclose(before[0], after[0], atol=1e-7) and torch.allclose(before[1], after[1], atol=1e-7)
    assert not torch.allclose(before[2], after[2], atol=1e-4)  # sample 2's own term did change
    # the batch term is the mean of the per-sample terms
    singles = [loss({k: (v[b:b + 1] if isinstance(v, torch.Tensor) else v) for k, v in f.items()})["word_patch"]
               for b in range(B)]
    assert loss(f)["word_patch"].item() == pytest.approx(sum(s.item() for s in singles) / B, rel=1e-5)


def test_subcaption_aggregated_patch_matches_reference():
    loss = make_loss(lambda_sub=1.3)
    f = make_features()
    out = loss(f)
    v, _ = ref_calibrated(loss, f)
    sub = [[ref._vec(f["sub_text"][b, i].detach()) for i in range(S)] for b in range(B)]
    valid = [[bool(x) for x in r] for r in f["sub_valid"]]
    assert out["subcaption_patch"].item() == pytest.approx(1.3 * ref.sap([v[b] for b in range(B)], sub, valid,
                                                                         3.0, -1.5),
                                              rel=1e-5)
    assert loss.stats["n_subcaptions"] == int(f["sub_valid"].sum())


def test_subcaption_aggregated_patch_masks_missing_sentences():
    loss = make_loss()
    f = make_features()
    base = loss(f)
    g = dict(f, sub_text=f["sub_text"].detach().clone())
    g["sub_text"][~f["sub_valid"]] = float("nan")             # missing sentences: neither rows nor columns
    out = loss(g)
    assert out["subcaption_patch"].item() == pytest.approx(base["subcaption_patch"].item(), rel=1e-6)
    sum(out.values()).backward()
    assert torch.isfinite(f["patches"].grad).all()


def test_at_most_max_subcaptions():
    loss = make_loss(max_subcaptions=2)
    f = make_features()
    out = loss(f)
    g = dict(f, sub_text=f["sub_text"][:, :2], sub_valid=f["sub_valid"][:, :2])
    assert out["subcaption_patch"].item() == pytest.approx(loss(g)["subcaption_patch"].item(), rel=1e-6)
    loss(f)
    assert loss.stats["n_subcaptions_dropped"] == int(f["sub_valid"][:, 2:].sum())


def test_gradients_are_finite_and_reach_every_new_parameter():
    loss = MulClipLoss(embed_dim=D, n_patches=P, context_length=L)
    head = loss.heads["global"]
    assert head.logit_scale.item() == pytest.approx(math.log(10)) and head.logit_bias.item() == -10.0
    f = make_features()
    out = loss(f)
    assert set(out) == {"contrastive", "contrastive_short", "word_patch", "subcaption_patch"}
    sum(out.values()).backward()
    for key in ("image", "text", "text_short", "patches", "text_tokens", "sub_text"):
        assert torch.isfinite(f[key].grad).all(), key
    for name, p in loss.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_sample_without_local_text_is_skipped():
    loss = make_loss()
    f = make_features()
    f["text_mask"] = f["text_mask"].clone()
    f["text_mask"][1] = False
    f["text_mask"][1, 1] = True                               # only the EOT is left: no local token
    out = loss(f)
    assert loss.stats["n_wpr_skipped"] == 1
    v, t = ref_calibrated(loss, f, samples=(0, 2, 3))
    expected = sum(ref.wpr_sample(v[b], t[b], 3.0, -1.5) for b in (0, 2, 3)) / 3
    assert out["word_patch"].item() == pytest.approx(expected, rel=1e-5)
    sum(out.values()).backward()
    assert torch.isfinite(f["text_tokens"].grad).all()


def test_global_only_ablation_needs_no_token_inputs():
    f = make_features()
    loss = make_loss(lambda_word=0.0, lambda_sub=0.0)
    out = loss({k: f[k] for k in ("image", "text", "text_short")})
    assert out["word_patch"].item() == 0.0 and out["subcaption_patch"].item() == 0.0
    assert out["contrastive"].item() == pytest.approx(make_loss()(f)["contrastive"].item(), rel=1e-6)
