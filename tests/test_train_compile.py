"""`train.compile: true` under bf16 autocast (the precision the GPU runs): the compiled step (the model's forward and
backward through torch.compile, the loss and the optimiser eager) gives the eager step's losses within bf16's
rounding, step by step from the same weights and batches, and still trains. Backend "aot_eager" (dynamo's capture
and AOTAutograd's graphs, eager kernels): the same graph path as inductor without code generation, seconds on the
CPU; inductor and fp32 at a tighter tolerance: tests/scale/test_compile.py."""
from __future__ import annotations

import pytest
import torch
from test_train_support import clip_step_losses

from clipfinetune.train import loop

# bf16 keeps 8 bits of mantissa (relative rounding 2^-8 ~ 0.4%); the graph may round the ~50k-param model's
# activations at other points than eager does, and the difference compounds over the steps: 2% over 10 steps,
# against a loss that falls by > 0.05 (a lost or repeated step, a missing gradient or stale weights move it more)
BF16_RTOL = 2e-2


def test_the_compiled_bf16_step_gives_the_eager_losses_within_bf16_rounding(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(loop, "COMPILE_BACKEND", "aot_eager")
    eager, eager_losses = clip_step_losses(False, precision="bf16")
    compiled, compiled_losses = clip_step_losses(True, precision="bf16")
    assert isinstance(compiled.ddp, torch._dynamo.eval_frame.OptimizedModule)
    assert compiled.step == eager.step == 10 and len(compiled_losses) == len(eager_losses) == 10
    assert eager_losses[-1] < eager_losses[0] - 0.05                      # it trains: the tolerance means something
    assert compiled_losses[0] == pytest.approx(eager_losses[0], rel=1e-2)  # the same weights and batch: one rounding
    for i, (a, b) in enumerate(zip(eager_losses, compiled_losses, strict=True)):
        assert b == pytest.approx(a, rel=BF16_RTOL), (i, eager_losses, compiled_losses)
