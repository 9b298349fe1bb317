"""ONE training loop for every method (nanoGPT-style: set-up, loop, checkpoint, in reading order).

A method changes what the batch holds (its loader examples), which loss runs (its named, weighted terms) and how
it answers the hooks of `methods/base.py` (extra parameter groups, the weight-decay rule, what to clamp after a
step, what to do after it); the loop calls them without asking which method it trains. What the loop decides:

- Data: a `BatchSource` yields the rank's micro-batches of an epoch, deterministically in (seed, epoch), starting
  at a given micro-batch position (resume). It must not consume the global RNGs (pass DataLoader a generator).
  Epoch e is `source.epoch_length(e) // accum_steps` optimiser steps (epochs may differ: the shard loader cuts
  one stream of passes into global batches, data/loader.py); a trailing partial group of micro-batches is dropped.
- Gradient accumulation is open_clip's feature cache (docs/design.md §12.1): a no-grad pass computes every
  micro-batch's features; then each micro-batch is recomputed with grad, substituted into the cached set, and the
  loss of the WHOLE step's batch is back-propagated. The summed gradients equal one step on the full batch (in-batch
  negatives span all `batch_size` samples; exact for every term that is a function of the concatenated features;
  shared 0-dim features such as the logit scale, and parameters owned by the loss module, get their gradient in
  one pass only: open_clip counts the logit scale's gradient k times). Cost: one extra forward per micro-batch. DDP
  gradient sync runs only on the last micro-batch (`no_sync`).
- Precision: bf16 / fp16 autocast around the model forward; features are cast to fp32 and the loss runs in fp32
  (logits of a softmax over the batch are precision-sensitive). fp16 (open_clip's `amp`) adds a GradScaler: the
  loss is scaled before the backward, the gradients unscaled before the norm/clip, and a step whose gradients
  overflow is skipped (its scale lowered), not an error; bf16 and fp32 have none.
- After the backward: global grad norm (clipped if `grad_clip > 0`); every term and the grad norm are averaged
  over ranks in one all-reduce. Then AdamW step, schedule step, `method.clamp` (open_clip: the logit scale to
  [0, ln 100]), `method.after_step`.
- Nothing in a step waits for the device: the logged values stay there and are fetched every `log_every` steps
  (and before every checkpoint and at the end), in one transfer; the monitor then gets each step's values.
- Non-finite guard, on the device: a flag turns on at the first step whose term, total or (without a GradScaler)
  grad norm is not finite, and stays on; while it is on the optimiser skips its update (fused AdamW's `found_inf`,
  the GradScaler's own mechanism), so the weights keep the last finite step's values. The next fetch raises
  `NonFiniteLossError` naming the first bad step and its term, before any checkpoint is written: the last checkpoint
  stays the last good one.
- `compile: true`: the DDP-wrapped model goes through `torch.compile` (forward and backward; the loss, the
  optimiser and this loop stay eager). Off by default: the sample DAG computes eagerly, as before.
- Checkpoints every `checkpoint_every` optimiser steps and at the end (`checkpoints/<run>/last.pt`, atomic).
  `resume()` (the caller's, before `fit`) loads a checkpoint with the same fingerprint (bit-exact on CPU); a
  different one is ignored (and overwritten by the first new checkpoint); an unreadable one is a clear error.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from clipfinetune.distributed import DistInfo, all_gather_objects, all_reduce_mean, current, wrap_ddp

from . import checkpoint as ckpt_io
from .config import TrainConfig, autocast, grad_scaler
from .optim import build_optimizer, build_scheduler, parameter_groups

log = logging.getLogger("clipfinetune.train")
# torch.compile's backend under `compile: true` (inductor: generated kernels; on the CPU it needs a C compiler). A
# module constant, not a param: the tests set "aot_eager" (the same graph capture without code generation).
COMPILE_BACKEND = "inductor"


class BatchSource(Protocol):
    def epoch_length(self, epoch: int) -> int: ...                       # micro-batches of `epoch` on this rank
    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]: ...  # from micro-batch `start` of `epoch`


class Monitor(Protocol):                    # train/monitor.py's (dvclive + progress bar), or a benchmark's recorder
    def log(self, step: int, scalars: dict[str, float]) -> None: ...


class NonFiniteLossError(RuntimeError):
    pass


class Trainer:
    def __init__(self, method, model, source: BatchSource, cfg: TrainConfig, *,
                 checkpoint_dir: str | os.PathLike | None = None, fingerprint: str = "", dist: DistInfo | None = None,
                 desc: str = "train"):
        self.method, self.source, self.cfg, self.desc = method, source, cfg, desc
        self.dist = dist or current()
        self.device = self.dist.device
        self.checkpoint_path = Path(checkpoint_dir) / ckpt_io.LAST if checkpoint_dir else None
        self.fingerprint = fingerprint

        self.module = method.build(model).to(self.device)
        self.loss_fn = method.loss().to(self.device)
        # steps per epoch (an epoch may have none: a pass smaller than a global batch ends inside the previous one)
        self.epoch_steps = [source.epoch_length(e) // cfg.accum_steps for e in range(cfg.epochs)]
        self.total_steps = sum(self.epoch_steps)
        if self.total_steps < 1:
            raise ValueError(f"{desc}: the data gives {source.epoch_length(0)} micro-batches per epoch on this rank, "
                             f"fewer than accum_steps={cfg.accum_steps}: nothing to train on")
        groups = parameter_groups(self.module, cfg.lr, cfg.wd, method.param_groups(self.module),
                                  no_decay=method.no_weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        # parameters the loss owns: they live in the built module too (DDP, checkpoints) and take their gradient in
        # ONE accumulation pass (the others in every pass: their features are recomputed per micro-batch)
        owned = {id(p) for p in self.loss_fn.parameters()}
        if owned - {id(p) for p in self.module.parameters()}:
            raise ValueError(f"{desc}: the loss owns parameters that are not in the built module; "
                             f"{type(method).__name__}"
                             f".build must register the loss module in it (methods/base.py)")
        self.feature_params = [p for p in self.params if id(p) not in owned]
        self.optimizer = build_optimizer(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup, self.total_steps)
        self.scaler = grad_scaler(cfg.precision, self.device)
        self.non_finite = torch.zeros((), dtype=torch.bool, device=self.device)   # on at the first bad step, stays on
        self.step, self._rng, self._saved_step = 0, None, None
        self.ddp = wrap_ddp(self.module, self.dist)
        if cfg.compile:        # after DDP, as PyTorch advises: its optimizer splits the graph at bucket boundaries
            self.ddp = torch.compile(self.ddp, backend=COMPILE_BACKEND)

    # ------------------------------------------------------------------------------------------ the loop
    def fit(self, monitor: Monitor | None = None) -> nn.Module:
        """Train to `total_steps` (from the step `resume()` restored); `monitor.log(step, scalars)` gets every step's
        values, in blocks of `log_every`. Returns the built module."""
        cfg, accum = self.cfg, self.cfg.accum_steps
        if self.step >= self.total_steps:
            log.info("%s: checkpoint %s is already complete (%d steps)", self.desc, self.checkpoint_path, self.step)
            return self.module
        if self._rng is not None:
            ckpt_io.set_rng_state(self._rng)
        else:
            ckpt_io.seed_everything(cfg.seed + self.dist.rank)
        self.module.train()
        pending, block_start = [], time.perf_counter()
        while self.step < self.total_steps:
            epoch, done = self.epoch_position(self.step)
            batches = iter(self.source.batches(epoch, start=done * accum))
            tick = time.perf_counter()
            for _ in range(done, self.epoch_steps[epoch]):
                micro = [self._to_device(self._next(batches, epoch)) for _ in range(accum)]
                data_s = time.perf_counter() - tick
                lrs = self.learning_rates()                    # this step's, before the schedule moves on
                pending.append((self.step + 1, self.train_step(micro), {"lrs": lrs, "data_s": data_s, "epoch": epoch}))
                checkpoint = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                if checkpoint or self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    self.log_values(pending, time.perf_counter() - block_start, monitor)  # raises on a bad step
                    pending = []
                    if checkpoint:
                        self.save()
                    block_start = time.perf_counter()
                tick = time.perf_counter()
            del batches
        if self._saved_step != self.step:
            self.save()
        return self.module

    def train_step(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        """One optimiser step over `accum_steps` micro-batches. Returns its logged values as 0-dim tensors on the
        device, read nowhere here: `loss_<term>` (each weighted term, averaged over ranks) and `grad_norm`."""
        terms = self.compute_gradients(micro_batches)
        self.scaler.unscale_(self.optimizer)                 # fp16: the true gradients for the norm and the clip
        if self.cfg.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        names = list(terms)
        values = all_reduce_mean(torch.stack([terms[n].float() for n in names] + [grad_norm.float().to(self.device)]))
        checked = values[:-1] if self.scaler.is_enabled() else values   # fp16: an overflow is the scaler's to skip
        self.non_finite |= ~torch.isfinite(checked).all()
        self.optimizer_step(skip=self.non_finite | ~torch.isfinite(values[-1]))
        self.scaler.update()                                 # fp16: a lower scale after an overflow
        self.scheduler.step()
        with torch.no_grad():
            self.method.clamp(self.module)
        self.method.after_step(self.module)
        self.step += 1
        return {**{f"loss_{n}": v for n, v in zip(names, values)}, "grad_norm": values[-1]}

    def compute_gradients(self, micro_batches: list[dict]) -> dict[str, torch.Tensor]:
        """Zero the grads and back-propagate the loss of the whole step's batch (feature cache if k > 1).
        Returns the detached terms (the full-batch values)."""
        self.optimizer.zero_grad(set_to_none=True)
        k = len(micro_batches)
        if k == 1:
            terms = self.loss_fn(self._forward(micro_batches[0]))
            self.scaler.scale(sum(terms.values())).backward()
            return {n: t.detach() for n, t in terms.items()}
        with torch.no_grad():
            cached = [self._forward(b) for b in micro_batches]
        for j, batch in enumerate(micro_batches):
            last = j == k - 1
            with contextlib.nullcontext() if last or not hasattr(self.ddp, "no_sync") else self.ddp.no_sync():
                features = merge_features(cached[:j] + [self._forward(batch)] + cached[j + 1:], j, last)
                terms = self.loss_fn(features)
                inputs = None if last or len(self.feature_params) == len(self.params) else self.feature_params
                torch.autograd.backward(self.scaler.scale(sum(terms.values())), inputs=inputs)
        return {n: t.detach() for n, t in terms.items()}

    def optimizer_step(self, skip: torch.Tensor) -> None:
        """AdamW's update, skipped on the device where `skip` (a 0-dim bool) is set: the fused kernel reads it as its
        `found_inf` (the GradScaler's protocol; the step counters stay too)."""
        if self.optimizer.defaults.get("fused"):
            self.optimizer.found_inf = skip.float()
            self.optimizer.step()
        elif not bool(skip):          # sync: only an unfused optimiser (parameters on several devices) reads it here
            self.optimizer.step()

    def learning_rates(self) -> dict[str, float]:
        """The learning rate of each optimiser group by its logged name (`lr`, `lr_<group>`): host values."""
        return {g["log_as"]: g["lr"] for g in self.optimizer.param_groups}

    def log_values(self, pending: list[tuple[int, dict, dict]], seconds: float, monitor: Monitor | None) -> None:
        """Fetch the block's values (one transfer), raise at its first non-finite step, then hand every step's
        scalars to the monitor: `loss` (the terms' sum), `loss_<term>`, `grad_norm`, `lr*`, `samples_per_s` (the
        block's global samples over its wall time: a step's own time means nothing while the device runs ahead),
        `data_s` (this step's wait for data), `epoch`."""
        fetched = torch.stack([torch.stack(list(values.values())) for _, values, _ in pending])
        rows = fetched.tolist()                # sync: once per `log_every` steps, checkpoint or end of training
        rate = len(pending) * self.cfg.micro_batch_size * self.cfg.accum_steps * self.dist.world_size / seconds
        for (step, values, host), row in zip(pending, rows):
            scalars = dict(zip(values, row))
            terms = {n: v for n, v in scalars.items() if n.startswith("loss_")}
            total = sum(terms.values())
            checked = [(f"term '{n[len('loss_'):]}'", v) for n, v in terms.items()] + [("total", total)]
            if not self.scaler.is_enabled():
                checked.append(("grad norm", scalars["grad_norm"]))
            for name, value in checked:
                if not math.isfinite(value):
                    raise NonFiniteLossError(
                        f"{self.desc}: non-finite {name} = {value} at optimiser step {step} (epoch {host['epoch']}); "
                        f"the weights were not updated from that step on (checked every {self.cfg.log_every} "
                        f"steps). Last good checkpoint: {self._checkpoint_note()}")
            if monitor is not None:
                monitor.log(step, {"loss": total, **scalars, **host["lrs"], "samples_per_s": rate,
                                   "data_s": host["data_s"], "epoch": host["epoch"]})

    # ------------------------------------------------------------------------------------------ pieces
    def _forward(self, batch: dict) -> dict:
        with autocast(self.cfg.precision, self.device):
            features = self.ddp(batch)
        return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in features.items()}

    def _to_device(self, batch):
        if torch.is_tensor(batch):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    def _next(self, batches: Iterator[dict], epoch: int) -> dict:
        try:
            return next(batches)
        except StopIteration:
            raise RuntimeError(f"{self.desc}: the data source ended early in epoch {epoch}: it promised "
                               f"{self.source.epoch_length(epoch)} micro-batches") from None

    def epoch_position(self, step: int) -> tuple[int, int]:
        """(epoch, optimiser steps done in it) at optimiser step `step`."""
        for epoch, n in enumerate(self.epoch_steps):
            if step < n:
                return epoch, step
            step -= n
        return len(self.epoch_steps), step

    # ------------------------------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        epoch, done = self.epoch_position(self.step)
        return {"fingerprint": self.fingerprint, "step": self.step, "epoch": epoch,
                "position": done * self.cfg.accum_steps,
                "epoch_steps": self.epoch_steps, "world_size": self.dist.world_size,
                "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "method": self.method.state_dict(),
                "config": self.cfg.as_dict(),
                **({"scaler": self.scaler.state_dict()} if self.scaler.is_enabled() else {})}    # fp16 only

    def save(self) -> None:
        rng = all_gather_objects(ckpt_io.rng_state())              # collective: every rank calls save()
        if self.checkpoint_path is not None and self.dist.is_main:
            ckpt_io.save_checkpoint(self.checkpoint_path, {**self.state(), "rng": rng})
        self._saved_step = self.step                            # on every rank: save() is collective

    def _checkpoint_note(self) -> str:
        if self.checkpoint_path is None:
            return "none (checkpointing off)"
        if self._saved_step is None or not self.checkpoint_path.exists():
            return f"none of this run yet ({self.checkpoint_path})"
        return f"{self.checkpoint_path} (step {self._saved_step}), intact"

    def resume(self) -> bool:
        """Load `checkpoint_dir/last.pt` if it belongs to this run (fingerprint, steps per epoch, world size); every
        rank loads the same file. Call before `fit`; returns whether a checkpoint was resumed."""
        if self.step:
            raise RuntimeError(f"{self.desc}: resume() after {self.step} steps: call it before fit()")
        path = self.checkpoint_path
        if path is None or not path.exists():
            return False
        ckpt = ckpt_io.load_checkpoint(path)
        mismatch = [k for k in ("fingerprint", "epoch_steps", "world_size")
                    if ckpt.get(k) != {"fingerprint": self.fingerprint, "epoch_steps": self.epoch_steps,
                                       "world_size": self.dist.world_size}[k]]
        if mismatch:
            log.warning("%s: checkpoint %s belongs to a different run (%s differ): training from scratch; "
                        "it will be overwritten by the first new checkpoint", self.desc, path, ", ".join(mismatch))
            return False
        self.module.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if "scaler" in ckpt:
            self.scaler.load_state_dict(ckpt["scaler"])
        self.method.load_state_dict(ckpt["method"])
        self.step, self._saved_step = ckpt["step"], ckpt["step"]
        self._rng = ckpt["rng"][self.dist.rank]
        log.info("%s: resuming from %s at step %d (epoch %d, micro-batch %d)", self.desc, path, self.step,
                 ckpt["epoch"], ckpt["position"])
        return True


def merge_features(parts: list[dict], own: int, last: bool) -> dict:
    """Concatenate micro-batches' features along dim 0 (part `own` carries grad). 0-dim tensors (shared values such
    as `logit_scale`) come from part `own` but keep their grad only in the `last` pass, so that their gradient is
    counted once, not k times (open_clip's accumulation counts the logit scale's gradient k times)."""
    merged = {}
    for key, value in parts[own].items():
        if torch.is_tensor(value) and value.ndim > 0:
            merged[key] = torch.cat([p[key] for p in parts], dim=0)
        elif torch.is_tensor(value) and not last:
            merged[key] = value.detach()
        else:
            merged[key] = value
    return merged
