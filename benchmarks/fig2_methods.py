"""Figure 2: per-method efficiency = (method step time / plain-CLIP step time) / (method FLOPs / plain-CLIP FLOPs).

Every method trains through the same `Trainer.train_step` (forward, loss, backward, grad clip, AdamW, logit-scale
clamp, `after_step`) on a FIXED batch of `BATCH` examples built by the method's own `make_example` from real shard
records (the ones it wants, in a seeded order), with the loss weights of params.yaml. No loader in the loop: this
figure is about the model side. Timing: 2 warm-up steps per method, then `ROUNDS` interleaved rounds of `STEPS`
steps per method (method order rotates each round), median step time.

FLOPs: `torch.utils.flop_counter.FlopCounterMode` around one `Trainer.compute_gradients` (forward + backward,
teachers included; the optimiser's element-wise work is not counted, its time is). While counting, attention runs
through the math SDPA backend and nn.MultiheadAttention's inference fast path is off, so the CPU fused attention
kernels (which FlopCounterMode has no formula for) are counted as their matmuls; timing uses the default kernels.

A ratio > 1 means the method's step costs more time than its extra FLOPs explain (Python overhead, small
kernels, memory traffic, non-FLOP work such as DeGLA's EMA update); < 1 means its extra work runs at a higher
FLOP rate than the plain step (bigger matmuls).
"""
from __future__ import annotations

import inspect
import io
import random
import tarfile
import time

from clipfinetune import registry

from .common import SHARDS, Row, load_params, median

BATCH = 32
ROUNDS, STEPS, WARMUP = 3, 3, 2
METHODS = (*registry.METHODS, registry.MIX)
_SAMPLES = None


class FixedSource:
    """A BatchSource yielding the same batch (the trainer's constructor only needs the length)."""

    def __init__(self, batch):
        self.batch = batch

    def epoch_length(self, epoch):
        return 10 ** 6

    def batches(self, epoch, start=0):
        while True:
            yield self.batch


def shard_samples() -> list[tuple[str, bytes, dict]]:
    """(key, jpg bytes, json record) of every train shard sample, in shard order (cached)."""
    import json

    global _SAMPLES
    if _SAMPLES is None:
        out = []
        for path in sorted(SHARDS.glob("train-*.tar")):
            members: dict[str, dict] = {}
            with tarfile.open(path) as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    key, ext = m.name.split(".", 1)
                    members.setdefault(key, {})[ext] = tf.extractfile(m).read()
            for key, mem in members.items():
                out.append((key, mem["jpg"], json.loads(mem["json"])))
        _SAMPLES = out
    return _SAMPLES


def make_batch(method, ctx, samples, n: int, seed: int = 0) -> dict:
    from PIL import Image
    from torch.utils.data import default_collate

    order = list(samples)
    random.Random(seed).shuffle(order)
    examples = []
    for key, jpg, rec in order:
        if not method.wants(rec):
            continue
        with Image.open(io.BytesIO(jpg)) as im:
            image = im.convert("RGB")
        examples.append(method.make_example(rec, image, random.Random(f"bench:{key}"), ctx))
        if len(examples) == n:
            return default_collate(examples)
    raise RuntimeError(f"method {method.name}: only {len(examples)} wanted samples in the shards, need {n}")


def method_config(name: str, params: dict) -> dict:
    from clipfinetune.methods import get_method

    cls = get_method(name)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"}
    pool = {**params["runs"][name], **(params["train"].get(name) or {})}     # the method's own run (params `runs`)
    return {k: v for k, v in pool.items() if k in accepted}


def setup(name: str, model_dir, params: dict, batch_size: int = BATCH):
    from clipfinetune.data.loader import ExampleContext
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import TrainConfig, Trainer

    model = load_model("local-dir:" + str(model_dir))
    method = build_method(name, **method_config(name, params))
    ctx = ExampleContext(model.transform, model.tokenize, model.image_size, token_span=model.token_span,
                         tokenize_long=lambda texts: model.tokenize(texts, context_length=248))
    batch = make_batch(method, ctx, shard_samples(), batch_size)
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=1e-5, warmup=0, wd=0.1, grad_clip=1.0)
    trainer = Trainer(method, model, FixedSource(batch), cfg, desc=f"bench-{name}")
    trainer.module.train()
    return trainer, batch


def count_flops(trainer, batch) -> int:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            trainer.compute_gradients([batch])
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    trainer.optimizer.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def figure(model_dir, *, methods=METHODS, log=print) -> list[Row]:
    params = load_params()
    setups, flops = {}, {}
    for name in methods:
        t0 = time.perf_counter()
        setups[name] = setup(name, model_dir, params)
        flops[name] = count_flops(*setups[name])
        log(f"  fig2 {name}: batch built, {flops[name] / 1e9:.2f} GFLOP fwd+bwd ({time.perf_counter() - t0:.1f} s)")
    for name, (trainer, batch) in setups.items():
        for _ in range(WARMUP):
            trainer.train_step([batch])
    times = {n: [] for n in setups}
    names = list(setups)
    for r in range(ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            trainer, batch = setups[name]
            for _ in range(STEPS):
                t0 = time.perf_counter()
                trainer.train_step([batch])
                times[name].append(time.perf_counter() - t0)
    base_t, base_f = median(times["clip"]), flops["clip"]
    rows = []
    for name in names:
        t = median(times[name])
        time_ratio, flop_ratio = t / base_t, flops[name] / base_f
        eff = time_ratio / flop_ratio
        log(f"  fig2 {name}: {t * 1e3:.0f} ms/step, time x{time_ratio:.2f}, FLOPs x{flop_ratio:.2f} -> {eff:.2f}")
        if name == "clip":
            continue
        rows.append(Row(f"2 {name} time-ratio / FLOP-ratio", t * 1e3, base_t * 1e3, eff, "<= 1.2", eff <= 1.2,
                        "ms/step",
                        {"batch_size": BATCH, "step_ms": t * 1e3, "clip_step_ms": base_t * 1e3,
                         "time_ratio": time_ratio, "gflop": flops[name] / 1e9, "clip_gflop": base_f / 1e9,
                         "flop_ratio": flop_ratio, "step_times_ms": [x * 1e3 for x in times[name]],
                         "config": method_config(name, params)},
                        [(f"in process: benchmarks.fig2_methods.figure(model, methods={list(methods)}) "
                         f"(Trainer.train_step on a fixed batch of {BATCH}; FlopCounterMode on compute_gradients)")]))
    return rows
