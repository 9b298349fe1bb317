"""benchmarks/calibration.json: measured throughput per device kind, architecture and method, the rates
`clipfinetune plan` turns into wall-time estimates (a figure it lacks is "unknown" in the plan, never a guess).

A figure: {"device": the device's name as the run saw it ("NVIDIA H200", "cpu"), "what": train_step | segments |
eval_images | lism_crops | loader | word_regions | sentences | paper_run, "arch", "method" (where they apply),
"batch" (optional: the per-rank batch a train_step, or train_step_compiled under torch.compile, was measured at; a step
below ~32 per GPU is latency-bound, so the plan interpolates between the small-batch floor and the batch-128 rate),
"value", "unit", "per" (GPU | process | worker | run), "settings" (what was measured), "source" (the command, the
machine, the date)}. `paper_run` is not a measurement: a paper's stated cost of one run, printed beside the plan's
estimate.

`record()` replaces the figures of the same (device, what, arch, method, batch) and keeps the others: the acceptance
run's rows (`python -m benchmarks.acceptance`, in this schema with `batch`), `python -m benchmarks --gpu`'s step
table and its SAM, eval and LISM rows on the card it ran on, `python -m benchmarks --scale` its CPU data stages.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

PATH = Path(__file__).resolve().parent / "calibration.json"
KEY = ("device", "what", "arch", "method", "batch")   # a figure without `batch`: ""


def record(figures: list[dict], path: Path = PATH) -> None:
    """Merge `figures` into calibration.json (written atomically), replacing the same (device, what, arch, method,
    batch); a figure without `batch` is one of its own key (the figures before per-rank batches were recorded)."""
    old = json.loads(path.read_text())["figures"] if path.is_file() else []
    new_keys = {tuple(f.get(k, "") for k in KEY) for f in figures}
    kept = [f for f in old if tuple(f.get(k, "") for k in KEY) not in new_keys]
    out = sorted(kept + figures, key=lambda f: tuple(str(f.get(k, "")) for k in KEY))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"figures": out}, indent=1) + "\n")
    os.replace(tmp, path)


def source(command: str) -> str:
    """Where a figure comes from: the command, the machine, the date."""
    import torch

    return (f"`{command}`, {platform.node() or 'this host'}, torch {torch.__version__}, "
            f"{datetime.date.today().isoformat()}")
