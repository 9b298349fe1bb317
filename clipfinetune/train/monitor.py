"""Rank-0 logging: dvclive scalars per optimiser step and a tqdm progress bar.

The caller builds the monitor and hands it to `Trainer.fit` (`with Monitor(...) as monitor: trainer.fit(monitor)`).
Logged at dvclive step = optimiser steps done: `loss` (the total), `loss_<term>` (every weighted term, averaged
over ranks), `lr` and `lr_<group>` (method groups), `grad_norm` (before clipping), `samples_per_s` (global
samples over wall time, data wait included, as open_clip; measured over each block of `log_every` steps, since
the loop does not wait for the device inside a block) and `epoch`. Every step gets its own row: the trainer
fetches the values in blocks of `log_every` steps and logs each step of the block at its own step number.

Nothing is opened before the first logged step, so a run whose checkpoint is already complete writes nothing.
`Live(dvcyaml=False, save_dvc_exp=False)`: dvc.yaml declares the plots itself, so dvclive never rewrites the
tracked pipeline file mid-repro. When resuming, rows logged after the checkpoint by the interrupted run are
dropped first, so the curves stay one continuous, duplicate-free history. dvclive writes its files in place, so a
run killed mid-write can leave a cut last row or a cut `metrics.json`; both are dropped before dvclive reads them
(the summary is rewritten at the next logged step).
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Self


class Monitor:
    def __init__(self, live_dir: str | os.PathLike | None, total_steps: int, start_step: int, resume: bool,
                 enabled: bool = True, desc: str = "train"):
        self.live_dir, self.total_steps, self.start_step, self.resume = live_dir, total_steps, start_step, resume
        self.enabled, self.desc = enabled, desc
        self.live = None
        self.bar = None

    def _open(self) -> None:
        if self.live_dir is not None:
            from dvclive import Live

            if self.resume:
                repair_history(self.live_dir, self.start_step)
            self.live = Live(str(self.live_dir), dvcyaml=False, save_dvc_exp=False, resume=self.resume, report=None)
        from tqdm.auto import tqdm

        self.bar = tqdm(total=self.total_steps, initial=self.start_step, desc=self.desc, dynamic_ncols=True,
                        mininterval=1.0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self._open()
        if self.live is not None:
            self.live.step = step
            for name, value in scalars.items():
                self.live.log_metric(name, value)
            self.live.next_step()
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{scalars['loss']:.4f}", lr=f"{scalars['lr']:.2e}",
                             sps=f"{scalars['samples_per_s']:.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.live is not None:
            self.live.end()
        self.bar = self.live = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def repair_history(live_dir: str | os.PathLike, last_step: int) -> None:
    """Make an interrupted run's dvclive folder resumable at `last_step`: drop every metric row with a larger
    step, any row a kill cut short, and a summary file that no longer parses."""
    for tsv in Path(live_dir, "plots", "metrics").rglob("*.tsv"):
        text = tsv.read_text()
        complete = text[:text.rfind("\n") + 1]                 # a last line without its newline was cut short
        rows = list(csv.reader(io.StringIO(complete), delimiter="\t"))
        if not rows:                                            # even the header was cut: dvclive writes it anew
            tsv.unlink()
            continue
        if "step" not in rows[0]:
            continue
        col = rows[0].index("step")
        kept = [rows[0]] + [r for r in rows[1:] if len(r) == len(rows[0]) and int(float(r[col])) <= last_step]
        if len(kept) != len(rows) or complete != text:
            out = io.StringIO()
            csv.writer(out, delimiter="\t", lineterminator="\n").writerows(kept)
            tsv.write_text(out.getvalue())
    summary = Path(live_dir, "metrics.json")
    if summary.exists():
        try:
            json.loads(summary.read_text())
        except ValueError:
            summary.unlink()
