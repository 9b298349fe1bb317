"""DeGLA loss terms against the float64 per-sample reference written from the paper (tests/reference)."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from fixtures.losses import assert_value_and_grads_match, with_grad
from reference import degla_reference as ref

from clipfinetune.losses.degla import (
    DeglaLoss,
    hard_negative_contrastive_loss,
    image_grounded_contrast_loss,
    self_distillation_loss,
    text_grounded_contrast_loss,
)

B, K, D = 4, 4, 8
TGC_SCALE = 10.0
STUDENT = ["image", "text", "neg_text", "logit_scale"]
TEACHER = ["teacher_image", "teacher_text", "teacher_neg_text"]


def make_features(seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    unit = lambda *s: F.normalize(torch.randn(*s, generator=g, dtype=torch.float64), dim=-1)
    neg_valid = torch.ones(b, K, dtype=torch.bool)
    neg_valid[0, 1] = False                      # one missing negative
    neg_valid[2] = False                         # a row without any negative
    f = {"image": unit(b, D), "text": unit(b, D), "neg_text": unit(b, K, D), "neg_valid": neg_valid,
         "logit_scale": torch.tensor(5.0, dtype=torch.float64)}
    for k in ["image", "text", "neg_text"]:      # the EMA teacher stays close to the student
        f["teacher_" + k] = F.normalize(f[k] + 0.3 * torch.randn(f[k].shape, generator=g, dtype=torch.float64),
                                        dim=-1)
    return f


TERMS = {
    "contrastive": (lambda f: hard_negative_contrastive_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"],
                                                             f["logit_scale"]),
                    lambda f: ref.base_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"], f["logit_scale"])),
    "igc": (lambda f: image_grounded_contrast_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"],
                                                   f["logit_scale"]),
            lambda f: ref.igc_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"], f["logit_scale"])),
    "tgc": (lambda f: text_grounded_contrast_loss(f["text"], f["teacher_text"], f["neg_text"], f["neg_valid"],
                                                  TGC_SCALE),
            lambda f: ref.tgc_loss(f["text"], f["teacher_text"], f["neg_text"], f["neg_valid"], TGC_SCALE)),
    "distill": (lambda f: self_distillation_loss(f["image"], f["text"], f["neg_text"], f["teacher_image"],
                                                 f["teacher_text"], f["teacher_neg_text"], f["neg_valid"]),
                lambda f: ref.distill_loss(f["image"], f["text"], f["neg_text"], f["teacher_image"],
                                           f["teacher_text"], f["teacher_neg_text"], f["neg_valid"])),
}


@pytest.mark.parametrize("term", list(TERMS))
def test_term_matches_reference_values_and_student_gradients(term):
    module_fn, ref_fn = TERMS[term]
    assert_value_and_grads_match(module_fn, ref_fn, make_features(0), STUDENT)


def test_module_returns_weighted_terms_eq_10():
    f = make_features(1)
    terms = DeglaLoss(lambda_igc=0.2, lambda_tgc=0.3, lambda_distill=0.01, tgc_logit_scale=TGC_SCALE)(f)
    assert set(terms) == {"contrastive", "igc", "tgc", "distill"}
    for name, weight in [("contrastive", 1.0), ("igc", 0.2), ("tgc", 0.3), ("distill", 0.01)]:
        torch.testing.assert_close(terms[name], weight * TERMS[name][1](f), msg=name)


def test_every_sample_negative_is_an_image_to_text_column_in_l_base():
    f = make_features(2)
    g = dict(f, neg_text=f["neg_text"].clone())
    g["neg_text"][3, 2] = f["image"][0]           # another sample's negative now matches image 0 closely
    before, after = TERMS["contrastive"][0](f), TERMS["contrastive"][0](g)
    assert after > before


@pytest.mark.parametrize("term", ["igc", "tgc"])
def test_local_contrasts_use_only_the_samples_own_negatives(term):
    module_fn = TERMS[term][0]
    f = with_grad(make_features(3))
    per_row = []
    for i in range(B):                           # the term restricted to row i
        row = {k: (v[i:i + 1] if v.ndim and k != "logit_scale" else v) for k, v in f.items()}
        per_row.append(module_fn(row))
    g = dict(f, neg_text=f["neg_text"].detach().clone())
    g["neg_text"][1] = F.normalize(torch.randn(K, D, dtype=torch.float64), dim=-1)   # perturb sample 1's negatives
    for i in [0, 3]:                            # rows 0 and 3 are unchanged ...
        row = {k: (v[i:i + 1] if v.ndim and k != "logit_scale" else v) for k, v in g.items()}
        torch.testing.assert_close(module_fn(row), per_row[i])
    # ... the batch term is the mean of its rows with a negative (row 2 has none) ...
    torch.testing.assert_close(module_fn(f), torch.stack([per_row[i] for i in [0, 1, 3]]).mean())
    # ... and row i's term does move with its own negatives
    module_fn(f).backward()
    assert f["neg_text"].grad[1].abs().sum() > 0 and f["neg_text"].grad[2].abs().sum() == 0


def test_tgc_differs_from_the_released_type_major_mask():
    """The released code's mask.repeat(1, K) picks columns k*N + i of sample-major negatives (docs/methods.md §4.3)."""
    f = make_features(4)
    f["neg_valid"] = torch.ones(B, K, dtype=torch.bool)
    all_neg = f["neg_text"].reshape(B * K, D)                      # sample-major, as the data are
    wrong = torch.stack([all_neg[[k * B + i for k in range(K)]] for i in range(B)])
    ours = TERMS["tgc"][0](f)
    torch.testing.assert_close(ours, ref.tgc_loss(f["text"], f["teacher_text"], f["neg_text"], f["neg_valid"],
                                                  TGC_SCALE))
    assert not torch.allclose(ours, ref.tgc_loss(f["text"], f["teacher_text"], wrong, f["neg_valid"], TGC_SCALE))


def test_missing_negative_is_excluded_everywhere():
    f = make_features(5)
    g = {k: v.clone() for k, v in f.items()}
    g["neg_text"][0, 1] = f["image"][0]           # garbage where the negative is missing, would matter if used
    g["teacher_neg_text"][0, 1] = -f["image"][0]
    terms_f, terms_g = DeglaLoss()(f), DeglaLoss()(g)
    for name in terms_f:
        torch.testing.assert_close(terms_f[name], terms_g[name], rtol=0, atol=0, msg=name)
    # not a zero vector with logit 0: marking the zero vector valid changes the softmax
    z = dict(f, neg_text=f["neg_text"].clone(), neg_valid=torch.ones(B, K, dtype=torch.bool))
    z["neg_text"][0, 1] = 0.0
    assert not torch.allclose(DeglaLoss()(z)["igc"], terms_f["igc"])


def test_no_negative_at_all_gives_finite_gradients_and_zero_local_terms():
    f = with_grad(make_features(6))
    f["neg_valid"] = torch.zeros(B, K, dtype=torch.bool)
    terms = DeglaLoss()(f)
    assert terms["igc"].item() == 0 and terms["tgc"].item() == 0
    sum(terms.values()).backward()
    for k in STUDENT:
        assert torch.isfinite(f[k].grad).all(), k
    torch.testing.assert_close(terms["contrastive"],
                               ref.base_loss(f["image"], f["text"], f["neg_text"], f["neg_valid"], f["logit_scale"]))


def test_teacher_inputs_get_no_gradient_and_gradients_are_finite():
    f = with_grad({k: (v.float() if v.is_floating_point() else v) for k, v in make_features(7).items()})
    f["logit_scale"] = torch.tensor(100.0, requires_grad=True)
    terms = DeglaLoss()(f)
    sum(terms.values()).backward()
    for k in TEACHER:
        assert f[k].grad is None, k
    for k in STUDENT:
        assert f[k].grad is not None and torch.isfinite(f[k].grad).all(), k


def test_neg_valid_is_optional():
    f = make_features(8)
    f["neg_valid"] = torch.ones(B, K, dtype=torch.bool)
    without = {k: v for k, v in f.items() if k != "neg_valid"}
    for name, value in DeglaLoss()(f).items():
        torch.testing.assert_close(DeglaLoss()(without)[name], value)


# ---- DDP: 2 gloo processes on halves of the batch == 1 process on the whole batch -------------------------

def ddp_features():
    f = make_features(9)
    # rank 0 gets rows 0-1, rank 1 rows 2-3. Local IGC/TGC means over rows with a negative match one process
    # only when every rank has as many such rows (as for any per-rank mean): one such row per rank here.
    f["neg_valid"][1] = False
    return f


def _ddp_worker(rank, world_size, init_file, out_dir):
    torch.set_num_threads(1)                        # forked child: keep OpenMP out of it
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        f = with_grad(ddp_features())
        half = B // world_size
        local = {k: (v[rank * half:(rank + 1) * half] if k != "logit_scale" else v) for k, v in f.items()}
        sum(DeglaLoss()(local).values()).backward()
        grads = {k: f[k].grad.clone() for k in STUDENT}
        for g in grads.values():                    # what DDP does to every parameter gradient
            dist.all_reduce(g)
            g /= world_size
        if rank == 0:
            torch.save(grads, os.path.join(out_dir, "grads.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_processes_match_one_process_gradients():
    single = with_grad(ddp_features())
    sum(DeglaLoss()(single).values()).backward()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_ddp_worker, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True,
                           start_method="fork")  # fork: no re-import of torch, well under a second
        grads = torch.load(os.path.join(tmp, "grads.pt"), weights_only=True)
    for k in STUDENT:
        torch.testing.assert_close(grads[k], single[k].grad, rtol=1e-7, atol=1e-10, msg=k)
