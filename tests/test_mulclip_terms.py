"""research/mulclip_terms.py: per-term gradient records of a step, checked on losses with known gradients."""
from __future__ import annotations

import pytest
import torch

from research.mulclip_terms import step_record


def _terms(w, head, a, b):
    return {"contrastive": w @ a, "contrastive_short": 0 * w.sum(), "word_patch": w @ b + 0 * head.sum(),
            "subcaption_patch": torch.zeros(())}


def test_orthogonal_local_gradient_under_the_clip_keeps_a_known_share_of_the_global_step():
    w, head = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
    rec = step_record(_terms(w, head, torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])), [w], [head], clip=1.0)
    assert rec["grad_norm"] == {"global": 3.0, "word": 4.0}          # sub is 0: not a live group
    assert rec["cos_with_global"] == {"word": 0.0}
    # the full step (3, 4) is scaled by 1/5 (progress 0.2 * 9 along g), the global one alone by 1/3 (1/3 * 9)
    assert rec["clip_scale"] == pytest.approx(0.2)
    assert rec["global_kept"] == pytest.approx((0.2 * 9.0) / (1 / 3 * 9.0))


def test_an_opposed_local_gradient_has_cosine_minus_one_and_without_clip_subtracts_its_share():
    w, head = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
    rec = step_record(_terms(w, head, torch.tensor([2.0, 0.0]), torch.tensor([-0.5, 0.0])), [w], [head], clip=0.0)
    assert rec["cos_with_global"] == {"word": -1.0}
    assert rec["global_kept"] == pytest.approx(0.75)                   # (2 - 0.5) / 2
