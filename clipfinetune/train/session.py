"""The wiring every training entry point shares (stages `train@<run>` and `pretrain`, the research probes in
benchmarks/), so that none repeats it: the device and the process group, the GLOBAL batch split per rank, the
settings (`TrainConfig`), the seed, the `Trainer` over a checkpoint folder whose fingerprint every rank agrees on,
its resume and its monitor (dvclive + progress bar on the main rank), the export by the main rank, and the clean-up.

    with training_session(settings, precision, device, batch_param="train.batch_size", log=log) as session:
        model = load_model(...)                          # after the seed: the same initial weights on every rank
        trainer = session.trainer(method, model, source, checkpoint_dir=..., fingerprint=fp)
        module = session.fit(trainer, live_dir)          # trainer.resume(), then trainer.fit(monitor)
        session.export(method.final_model(module, model), out_dir, live_dir=..., record={...})
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clipfinetune.distributed import DistInfo, cleanup, init_distributed

from .checkpoint import check_ranks_agree, remove_checkpoints, seed_everything
from .config import TrainConfig, per_rank_batch_size, resolve_precision
from .loop import Trainer
from .monitor import Monitor


@dataclass
class TrainingSession:
    dist: DistInfo
    cfg: TrainConfig              # batch_size: this rank's share of `global_batch`
    global_batch: int

    def trainer(self, method, model, source, *, cfg: TrainConfig | None = None, checkpoint_dir=None,
                fingerprint: str = "", desc: str = "train") -> Trainer:
        """The one Trainer on this session's ranks (`cfg`: another phase's settings, e.g. pretrain's label warm-up);
        with a fingerprint, every rank must hold the same one first (a rank whose code, data or params differ would
        resume, or start, another run than its peers)."""
        if fingerprint:
            check_ranks_agree(fingerprint, self.dist)
        return Trainer(method, model, source, cfg or self.cfg, checkpoint_dir=checkpoint_dir, fingerprint=fingerprint,
                       dist=self.dist, desc=desc)

    def fit(self, trainer: Trainer, live_dir: str | os.PathLike | None = None):
        """`trainer.resume()` (its checkpoint, when the fingerprint matches), then `trainer.fit` logging every step to
        the main rank's monitor (dvclive in `live_dir`, resumed with the run; a progress bar). Returns the module."""
        resumed = trainer.resume()
        with Monitor(live_dir, trainer.total_steps, trainer.step, resumed, self.dist.is_main, trainer.desc) as monitor:
            return trainer.fit(monitor)

    def export(self, model, out_dir: str | os.PathLike, *, live_dir: str | os.PathLike | None = None,
               note: str = "data.json", record: dict | None = None, publish_to: str | os.PathLike | None = None,
               checkpoint_dir: str | os.PathLike | None = None, keep_checkpoint: bool = True) -> None:
        """On the main rank: `model` exported to `out_dir` (open_clip's local-dir layout), `record` with the device
        and the batch split written to `live_dir/note`, `live_dir` copied to `publish_to` (the stage's output: curves
        grow beside the checkpoint they resume with, and a finished copy is an output DVC's run cache can restore),
        and the resume checkpoints removed unless kept (DVC caches the exported model)."""
        if not self.dist.is_main:
            return
        from clipfinetune.io import copy_dir, write_json
        from clipfinetune.models import export_model

        export_model(model, out_dir)
        if live_dir is not None:
            write_json(Path(live_dir) / note, {**(record or {}), "device": str(self.dist.device),
                                               "ranks": self.dist.world_size, "global_batch": self.global_batch,
                                               "rank_batch": self.cfg.batch_size,
                                               "precision": self.cfg.precision})
        if live_dir is not None and publish_to is not None:
            copy_dir(live_dir, publish_to)
        if checkpoint_dir is not None and not keep_checkpoint:
            remove_checkpoints(checkpoint_dir)


@contextlib.contextmanager
def training_session(settings: dict, precision: str, device: str | None = "auto", *,
                     batch_param: str = "train.batch_size", log=None) -> Iterator[TrainingSession]:
    """`settings`: `TrainConfig`'s fields with `batch_size` the GLOBAL batch (the papers' number), split over the
    ranks so that steps per epoch and the schedule do not depend on their number (an error naming `batch_param`
    when it does not divide). Seeds every RNG with `settings["seed"]` (the same initial weights on every rank); the
    process group is destroyed on the way out, whatever happens."""
    dist = init_distributed(device)
    try:
        global_batch = int(settings["batch_size"])
        rank_batch = per_rank_batch_size(global_batch, dist.world_size, batch_param)
        cfg = TrainConfig(**{**settings, "batch_size": rank_batch},
                          precision=resolve_precision(precision, dist.device, log))
        if log is not None:
            log.info("global batch %d = %d rank(s) x %d per rank, on %s", global_batch, dist.world_size, rank_batch,
                     dist.device)
        seed_everything(cfg.seed)
        yield TrainingSession(dist, cfg, global_batch)
    finally:
        cleanup()

