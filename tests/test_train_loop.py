"""The training loop's step: optimisation, accumulation, precision, parameter groups, schedule, hooks, settings."""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from test_train_support import TinyClipModel, ToySource, config, fixed_batch

from clipfinetune.methods import METHODS as _METHODS  # noqa: F401  (registry import works without heavy deps)
from clipfinetune.methods import MethodNotImplemented, get_method
from clipfinetune.methods.clip import ClipMethod
from clipfinetune.train import Trainer, merge_train_settings
from clipfinetune.train.optim import build_scheduler, parameter_groups

torch.set_num_threads(1)


def reference_clip_loss(model, batch) -> torch.Tensor:
    """Independent symmetric InfoNCE of the whole batch (not the loss module under test)."""
    with torch.no_grad():
        img = F.normalize(model.clip.encode_image(batch["image"]), dim=-1)
        txt = F.normalize(model.clip.encode_text(batch["text"]), dim=-1)
        logits = model.clip.logit_scale.exp() * img @ txt.T
        labels = torch.arange(len(img))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def trainer_for(model=None, method=None, **cfg):
    return Trainer(method or ClipMethod(), model or TinyClipModel(), ToySource(), config(**cfg))


def total_loss(values: dict) -> float:
    return sum(float(v) for k, v in values.items() if k.startswith("loss_"))


def test_one_optimiser_step_lowers_the_loss_on_a_fixed_batch():
    trainer = trainer_for(lr=1e-3)
    batch = fixed_batch(8)
    before = reference_clip_loss(trainer.module.model, batch)
    values = trainer.train_step([batch])
    after = reference_clip_loss(trainer.module.model, batch)
    assert total_loss(values) == pytest.approx(before.item(), rel=1e-5)
    assert after < before
    assert trainer.step == 1


def gradients(trainer):
    return {n: p.grad.clone() for n, p in trainer.module.named_parameters() if p.grad is not None}


def test_accumulating_k_micro_batches_equals_one_step_on_the_whole_batch():
    batch = fixed_batch(8)
    whole = trainer_for(batch_size=8, accum_steps=1)
    accumulated = trainer_for(batch_size=8, accum_steps=4)
    terms_whole = whole.compute_gradients([batch])
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in range(0, 8, 2)]
    terms_acc = accumulated.compute_gradients(micro)
    assert terms_acc["contrastive"].item() == pytest.approx(terms_whole["contrastive"].item(), rel=1e-6)
    g_whole, g_acc = gradients(whole), gradients(accumulated)
    assert g_whole.keys() == g_acc.keys()
    for name in g_whole:
        torch.testing.assert_close(g_acc[name], g_whole[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_autocast_branch_runs_a_step_on_cpu():
    seen = {}

    class Spy(ClipMethod):
        def build(self, model):
            module = super().build(model)
            inner = module.forward

            def forward(batch):
                seen["autocast"] = torch.is_autocast_enabled("cpu")
                seen["dtype"] = torch.get_autocast_dtype("cpu")
                return inner(batch)
            module.forward = forward
            return module

    trainer = trainer_for(method=Spy(), precision="bf16")
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    values = trainer.train_step([fixed_batch(8)])
    assert seen == {"autocast": True, "dtype": torch.bfloat16}
    assert math.isfinite(total_loss(values))
    assert any(not torch.equal(p, before[n]) for n, p in trainer.module.named_parameters())


def test_bf16_on_cpu_is_kept_and_emulated_bf16_is_named(monkeypatch, caplog):
    from clipfinetune.train import config as train_config

    cpu = torch.device("cpu")
    assert train_config.resolve_precision("fp32", cpu) == "fp32"
    log = logging.getLogger("test-precision")
    said = "precision bf16: bf16 autocast on cpu"          # one line to grep on every host (tests/scale greps it)
    monkeypatch.setattr(train_config, "cpu_has_native_bf16", lambda: True)
    with caplog.at_level(logging.INFO):
        assert train_config.resolve_precision("bf16", cpu, log) == "bf16"
    assert [r.levelno for r in caplog.records] == [logging.INFO]           # native: no warning
    assert said in caplog.text and "emulated" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(train_config, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level(logging.INFO):
        assert train_config.resolve_precision("bf16", cpu, log) == "bf16"       # the same result, only slower
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert said in caplog.text and "emulated" in caplog.text


@pytest.mark.parametrize("avx512_bf16,amx,native", [(False, False, False), (True, False, True), (False, True, True)])
def test_native_bf16_is_read_from_the_cpu_flags_not_from_onednn(monkeypatch, avx512_bf16, amx, native):
    # oneDNN says "bf16 supported" on every AVX512 core (it emulates it there): that answer must not count
    from clipfinetune.train import config as train_config

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert train_config.cpu_has_native_bf16() is native


def test_by_default_the_logit_scale_is_clamped_to_ln_100_after_each_step_and_after_step_runs_after_it():
    calls = []

    class Hooked(ClipMethod):
        def after_step(self, module):
            calls.append(module.model.clip.logit_scale.item())

    model = TinyClipModel()
    with torch.no_grad():
        model.clip.logit_scale.fill_(8.0)
    trainer = trainer_for(model=model, method=Hooked())
    trainer.train_step([fixed_batch(8)])
    trainer.train_step([fixed_batch(8)])
    assert len(calls) == 2 and calls[0] == pytest.approx(math.log(100))     # from 8.0: clamped
    assert all(v <= math.log(100) + 1e-6 for v in calls)


def test_the_methods_clamp_hook_runs_after_every_optimiser_step_without_grad_and_before_after_step():
    """The trainer clamps what the method says (here: the text projection's entries to +-0.01), nothing by name."""
    calls = []

    class ClampsProjection(ClipMethod):
        def clamp(self, module):
            calls.append(("clamp", torch.is_grad_enabled(), trainer.step))
            module.model.clip.text_projection.clamp_(-0.01, 0.01)

        def after_step(self, module):
            calls.append(("after_step", module.model.clip.text_projection.abs().max().item()))

    model = TinyClipModel()
    with torch.no_grad():
        model.clip.logit_scale.fill_(8.0)
    trainer = trainer_for(model=model, method=ClampsProjection())
    trainer.train_step([fixed_batch(8)])
    trainer.train_step([fixed_batch(8)])
    assert [c[0] for c in calls] == ["clamp", "after_step"] * 2
    assert [c[1:] for c in calls[::2]] == [(False, 0), (False, 1)]
    assert all(c[1] <= 0.01 for c in calls[1::2])
    assert model.clip.logit_scale.item() > math.log(100)        # its hook replaces open_clip's clamp


def test_no_weight_decay_on_norms_biases_1d_params_and_logit_scale():
    model = TinyClipModel()
    norm_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
    groups = parameter_groups(model, lr=1e-3, wd=0.2)
    wd_of = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    assert len(wd_of) == sum(1 for _ in model.parameters())
    for name, p in model.named_parameters():
        exempt = id(p) in norm_params or name.endswith("bias") or "logit_scale" in name or p.ndim < 2
        assert wd_of[id(p)] == (0.0 if exempt else 0.2), name
    assert wd_of[id(model.clip.visual.conv1.weight)] == 0.2
    assert wd_of[id(model.clip.logit_scale)] == 0.0


def test_goals_hooks_decay_every_parameter_and_never_clamp_its_logit_scale():
    """GOAL's code: AdamW(model.parameters(), wd) with no exclusions, no clamp of logit_scale (docs/methods.md §3.2):
    GoalMethod answers the two hooks so, and the trainer follows whatever a method answers."""
    from clipfinetune.methods.goal import GoalMethod

    class GoalConventions(ClipMethod):
        no_weight_decay = GoalMethod.no_weight_decay
        clamp = GoalMethod.clamp

    model = TinyClipModel()
    with torch.no_grad():
        model.clip.logit_scale.fill_(8.0)
    trainer = trainer_for(model=model, method=GoalConventions(), wd=0.2)
    assert {g["name"] for g in trainer.optimizer.param_groups} == {"default"}
    assert all(g["weight_decay"] == 0.2 for g in trainer.optimizer.param_groups)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == sum(1 for _ in model.parameters())
    trainer.train_step([fixed_batch(8)])
    assert model.clip.logit_scale.item() > math.log(100)        # stepped from 8.0, never clamped to 4.6


def test_a_method_without_hooks_takes_open_clips_step():
    """A method that only builds features and a loss trains as open_clip's loop does: AdamW over the open_clip
    decay groups, global grad-norm clip, logit scale clamped to [0, ln 100] (an independent re-implementation here,
    on a copy of the same model)."""
    from clipfinetune.methods.base import Method

    class Bare(Method):                 # no hook overridden
        def build(self, model):
            return ClipMethod().build(model)

        def loss(self):
            return ClipMethod().loss()

    model = TinyClipModel()
    with torch.no_grad():
        model.clip.logit_scale.fill_(8.0)                       # above ln 100: the first step's clamp matters
    reference = copy.deepcopy(model)
    # a large eps keeps Adam from turning rounding noise of near-zero gradients into whole steps (g / |g|)
    trainer = trainer_for(model=model, method=Bare(), lr=1e-2, wd=1.0, grad_clip=0.5, eps=1e-3)
    exempt = [p for n, p in reference.named_parameters()
              if p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n]
    decayed = [p for p in reference.parameters() if all(p is not q for q in exempt)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 1.0}, {"params": exempt, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.98), eps=1e-3)
    for step in range(3):
        batch = fixed_batch(8, epoch=step)
        trainer.train_step([batch])
        for group in optimizer.param_groups:                    # cosine over the run's 5 steps, no warm-up
            group["lr"] = 1e-2 * 0.5 * (1 + math.cos(math.pi * step / trainer.total_steps))
        optimizer.zero_grad()
        reference_loss_with_grad(reference, batch).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        optimizer.step()
        with torch.no_grad():
            reference.clip.logit_scale.clamp_(0, math.log(100))
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)    # a rule missed: >= 1e-2 apart


def reference_loss_with_grad(model, batch) -> torch.Tensor:
    img = F.normalize(model.clip.encode_image(batch["image"]), dim=-1)
    txt = F.normalize(model.clip.encode_text(batch["text"]), dim=-1)
    logits = model.clip.logit_scale.exp() * img @ txt.T
    labels = torch.arange(len(img))
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def test_method_param_groups_get_their_own_learning_rate_and_are_logged_under_their_name():
    class NewModules(ClipMethod):
        def param_groups(self, module):
            return [{"name": "new", "params": [module.model.clip.text_projection], "lr": 5e-2}]

    trainer = trainer_for(method=NewModules(), lr=1e-3)
    by_name = {g["name"]: g for g in trainer.optimizer.param_groups}
    assert [p is trainer.module.model.clip.text_projection for p in by_name["new"]["params"]] == [True]
    assert by_name["new"]["lr"] == 5e-2 and by_name["default"]["lr"] == 1e-3
    assert trainer.learning_rates() == {"lr": 1e-3, "lr_new": 5e-2}
    logged = Recorder()
    trainer.fit(logged)
    assert (logged.scalars[1]["lr"], logged.scalars[1]["lr_new"]) == (1e-3, 5e-2)    # step 1: no warm-up
    assert all(s["lr_new"] / s["lr"] == pytest.approx(50) for s in logged.scalars.values())   # one schedule
    with pytest.raises(ValueError, match="'default' is the trainer's own group"):
        parameter_groups(trainer.module, 1e-3, 0.1, [{"name": "default", "params": [], "lr": 1.0}])


class Recorder:
    """A monitor: every logged step's scalars, by step."""

    def __init__(self):
        self.scalars = {}

    def log(self, step, scalars):
        self.scalars[step] = scalars


def test_every_step_is_logged_with_the_same_values_whatever_log_every_is():
    """The values are fetched from the device in blocks of log_every; every step still gets its own row."""
    runs = {}
    for log_every in (1, 3, 100):
        logged = Recorder()
        trainer_for(epochs=2, log_every=log_every).fit(logged)      # 5 steps an epoch
        runs[log_every] = logged.scalars
    assert list(runs[1]) == list(range(1, 11))
    keys = ("loss", "loss_contrastive", "grad_norm", "lr", "epoch")
    for log_every in (3, 100):
        assert list(runs[log_every]) == list(range(1, 11))
        assert [[s[k] for k in keys] for s in runs[log_every].values()] \
            == [[s[k] for k in keys] for s in runs[1].values()]
    assert all(s["samples_per_s"] > 0 and s["data_s"] >= 0 for s in runs[3].values())


def test_cosine_schedule_with_linear_warmup_matches_the_formula():
    p = torch.nn.Parameter(torch.zeros(2, 2))
    opt = torch.optim.AdamW([{"params": [p], "lr": 0.5}])
    sched = build_scheduler(opt, warmup=4, total=20)
    got = []
    for _ in range(20):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [0.5 * (s + 1) / 4 for s in range(4)] + \
               [0.25 * (1 + math.cos(math.pi * (s - 4) / 16)) for s in range(4, 20)]
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[3] == pytest.approx(0.5) and got[4] == pytest.approx(0.5)


def test_overrides_replace_shared_keys_and_unknown_keys_fail():
    shared = {"lr": 1e-4, "epochs": 2, "batch_size": 8}
    settings, extras = merge_train_settings(shared, {"lr": 1e-5, "new_module_lr": 2e-4}, {"new_module_lr"})
    assert settings == {"lr": 1e-5, "epochs": 2, "batch_size": 8} and extras == {"new_module_lr": 2e-4}
    with pytest.raises(ValueError, match="unknown override keys.*'lrr'"):
        merge_train_settings(shared, {"lrr": 1e-5})
    with pytest.raises(ValueError, match="new_module_lr"):
        merge_train_settings(shared, {"new_module_lr": 2e-4})       # not this method's key


def test_registry_finds_clip_and_names_missing_methods(monkeypatch):
    assert get_method("clip") is ClipMethod
    import clipfinetune.methods as registry

    monkeypatch.setattr(registry, "METHODS", registry.METHODS + ("not_written",))
    with pytest.raises(MethodNotImplemented, match="method 'not_written' not implemented yet"):
        get_method("not_written")
    with pytest.raises(ValueError, match="unknown method"):
        get_method("nope")


class LearnableTemperature(ClipMethod):
    """A loss that owns a parameter (as MulCLIP's heads), registered in the built module and given its own learning
    rate by `param_groups`: its gradient must not be counted once per micro-batch."""

    def build(self, model):
        module = super().build(model)
        module.loss_module = self._loss = _ScaledClipLoss()
        return module

    def loss(self):
        return self._loss

    def param_groups(self, module):
        return [{"name": "temperature", "params": [module.loss_module.scale], "lr": 0.5}]


class _ScaledClipLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.3))

    def forward(self, f):
        logits = self.scale * f["logit_scale"] * f["image"] @ f["text"].T
        labels = torch.arange(len(logits))
        return {"contrastive": (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2}


def test_a_loss_owned_parameter_gets_its_lr_group_and_its_gradient_once_under_accumulation():
    batch = fixed_batch(8)
    whole = trainer_for(method=LearnableTemperature(), batch_size=8, accum_steps=1, lr=1e-3)
    accumulated = trainer_for(method=LearnableTemperature(), batch_size=8, accum_steps=2, lr=1e-3)
    owned = accumulated.module.loss_module.scale
    assert [g["lr"] for g in accumulated.optimizer.param_groups if any(p is owned for p in g["params"])] == [0.5]
    assert accumulated.learning_rates() == {"lr": 1e-3, "lr_temperature": 0.5}
    whole.compute_gradients([batch])
    accumulated.compute_gradients([{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}])
    g_whole, g_acc = gradients(whole), gradients(accumulated)
    assert "loss_module.scale" in g_whole
    for name in g_whole:
        torch.testing.assert_close(g_acc[name], g_whole[name], rtol=1e-4, atol=1e-6, msg=name)
    before = owned.detach().clone()
    accumulated.train_step([{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}])
    assert not torch.equal(owned, before)                       # optimised, at its own rate


def test_a_loss_owning_a_parameter_outside_the_built_module_is_refused():
    class Unregistered(LearnableTemperature):
        def build(self, model):
            self._loss = _ScaledClipLoss()                      # never registered: DDP and checkpoints miss it
            return ClipMethod.build(self, model)

        def param_groups(self, module):
            return []

    with pytest.raises(ValueError, match="loss owns parameters that are not in the built module"):
        trainer_for(method=Unregistered())


def test_the_trainer_names_no_method():
    """What differs between methods is a hook (methods/base.py): no method's name in clipfinetune/train/, except in
    a comment line naming a paper."""
    import re
    from pathlib import Path

    from clipfinetune.registry import METHODS

    names = re.compile("|".join([m for m in METHODS if m != "clip"] + ["fsc"]), re.IGNORECASE)  # clip: clip_grad
    train = Path(__file__).resolve().parents[1] / "clipfinetune" / "train"
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(train.glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if names.search(line) and not line.strip().startswith("#")]
    assert found == []
