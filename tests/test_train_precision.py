"""`model.precision: fp16`: open_clip's `amp` (fp16 autocast + GradScaler) in the training loop, on CPU where torch
allows it; the CPU fallback to bf16 and the CUDA selection of fp16 (mocked device)."""
from __future__ import annotations

import logging
import math
import types

import pytest
import torch
from test_train_support import TinyClipModel, ToySource, config, fixed_batch

from clipfinetune.methods.clip import ClipMethod
from clipfinetune.train import Trainer
from clipfinetune.train import config as train_config

torch.set_num_threads(1)


class Spy(ClipMethod):
    """Records the autocast state the model forward runs under."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def build(self, model):
        module = super().build(model)
        inner = module.forward

        def forward(batch):
            self.seen.update(autocast=torch.is_autocast_enabled("cpu"), dtype=torch.get_autocast_dtype("cpu"))
            return inner(batch)
        module.forward = forward
        return module


def trainer(precision, **cfg):
    return Trainer(Spy(), TinyClipModel(seed=0), ToySource(), config(precision=precision, grad_clip=0.0, **cfg))


def grads(t):
    return {n: p.grad.clone() for n, p in t.module.named_parameters() if p.grad is not None}


def test_fp16_scales_the_loss_and_unscales_the_gradients_to_the_fp32_ones():
    batch = fixed_batch(8)
    fp32, fp16 = trainer("fp32"), trainer("fp16")
    assert not fp32.scaler.is_enabled() and fp16.scaler.is_enabled() and fp16.scaler.get_scale() == 2.0 ** 16
    fp16.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)   # this toy's scaled gradients fit fp16
    fp32.compute_gradients([batch])
    fp16.compute_gradients([batch])
    assert fp16.method.seen == {"autocast": True, "dtype": torch.float16}
    assert fp32.method.seen["autocast"] is False
    scale = fp16.scaler.get_scale()
    g32, scaled = grads(fp32), grads(fp16)
    fp16.scaler.unscale_(fp16.optimizer)
    g16 = grads(fp16)
    assert g32.keys() == g16.keys()
    big = max(g32, key=lambda n: g32[n].abs().max())
    # before unscale_: the gradient of scale * loss; after: the fp32 gradient, up to fp16's rounding
    torch.testing.assert_close(scaled[big] / scale, g16[big])
    for n in g32:
        torch.testing.assert_close(g16[n], g32[n], rtol=0.05, atol=2e-3 * g32[n].abs().max().item() + 1e-6, msg=n)


def test_an_fp16_step_that_overflows_is_skipped_by_the_scaler_not_an_error():
    t = trainer("fp16")
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)     # scaled fp16 gradients overflow to inf
    before = {n: p.detach().clone() for n, p in t.module.named_parameters()}
    values = t.train_step([fixed_batch(8)])
    assert math.isfinite(values["loss_contrastive"]) and not math.isfinite(values["grad_norm"])
    assert not t.non_finite                                        # the scaler's to skip, not an error
    assert all(torch.equal(p, before[n]) for n, p in t.module.named_parameters())    # weights untouched
    assert t.scaler.get_scale() == 2.0 ** 126                                        # backoff factor 0.5
    assert t.step == 1
    t.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)         # a scale that fits: a real step
    values = t.train_step([fixed_batch(8)])
    assert math.isfinite(values["grad_norm"]) and t.scaler.get_scale() == 2.0 ** 8
    assert any(not torch.equal(p, before[n]) for n, p in t.module.named_parameters())


def test_fp16_checkpoints_carry_the_scaler_state_and_fp32_ones_do_not():
    t = trainer("fp16")
    t.train_step([fixed_batch(8)])
    assert t.state()["scaler"]["scale"] == t.scaler.get_scale()
    assert "scaler" not in trainer("fp32").state() and "scaler" not in trainer("bf16").state()


def test_fp16_is_selected_on_cuda_and_falls_back_to_bf16_with_a_warning_on_cpu(caplog):
    log = logging.getLogger("test-precision")
    cuda = types.SimpleNamespace(type="cuda")                  # resolve_precision reads only the device type
    with caplog.at_level(logging.WARNING):
        assert train_config.resolve_precision("fp16", cuda, log) == "fp16"
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert train_config.resolve_precision("fp16", torch.device("cpu"), log) == "bf16"
    assert "needs CUDA" in caplog.text
    with pytest.raises(ValueError, match="precision must be one of"):
        config(precision="amp")
