"""`train.compile: true` (clipfinetune/train/loop.py): the Trainer runs the model through torch.compile and trains
as the eager model does: the same optimiser steps, per-step losses within LOSS_RTOL.

Backends: "aot_eager" (dynamo's graph capture and AOTAutograd's forward/backward graphs, run by eager kernels) and
"inductor" (the default of `train.compile`: generated C++ kernels; skipped where no C compiler is on PATH). Set
through loop.COMPILE_BACKEND, the param-free hook. Compilation takes minutes on 2 loaded CPU cores: tests/scale/.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from test_train_support import clip_step_losses, config

from clipfinetune.train import loop

# Inductor fuses and reorders float reductions (aot_eager may decompose ops), so the bits differ from eager; over
# these 10 steps of a ~50k-param CLIP at lr 1e-3 the differences stay at float32 rounding (~1e-6 relative). 1e-4
# is far below what a wrong graph gives: a step lost or repeated, a missing gradient (frozen tower) or stale weights
# move the loss by >1e-2 here (the loss falls ~0.02 per step).
LOSS_RTOL = 1e-4


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_compiled_run_takes_the_same_steps_with_the_same_losses(backend, monkeypatch):
    if backend == "inductor" and not (shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("inductor on the CPU needs a C compiler")
    torch._dynamo.reset()
    monkeypatch.setattr(loop, "COMPILE_BACKEND", backend)
    eager, eager_losses = clip_step_losses(False)
    compiled, compiled_losses = clip_step_losses(True)
    assert isinstance(compiled.ddp, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(eager.ddp, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled.step == eager.step == compiled.total_steps == 10
    assert len(compiled_losses) == len(eager_losses) == 10
    assert eager_losses[-1] < eager_losses[0] - 0.05                       # it trains: the tolerance means something
    for i, (a, b) in enumerate(zip(eager_losses, compiled_losses, strict=True)):
        assert b == pytest.approx(a, rel=LOSS_RTOL), (i, eager_losses, compiled_losses)
    # the checkpointed module is the uncompiled one: its weights follow the compiled steps
    for (name, p), q in zip(eager.module.named_parameters(), compiled.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-3, atol=1e-5, msg=name)


def test_compile_must_be_a_boolean():
    with pytest.raises(ValueError, match="compile must be true or false"):
        config(compile="yes")
