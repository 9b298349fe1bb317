"""Sizes and time: each stage's row (units per epoch, items, bytes, LLM requests) and its time from the measured
figures of benchmarks/calibration.json: measured, scaled (from what, by what rule) or unknown."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from clipfinetune import host
from clipfinetune.project.plan.common import Refusal, _fmt_seconds, _get, _method
from clipfinetune.project.plan.hardware import _training_ranks
from clipfinetune.runs import batch_param

CALIBRATION = Path("benchmarks") / "calibration.json"      # relative to the project root


LARGE_BATCH = 128          # a train_step figure without `batch` was measured at 128 per rank (the step tables)


LATENCY_BOUND = 32         # below this per-rank batch a step costs about as much as a tiny one (measured: 2 and 16)


# -------------------------------------------------------------------------------------- the loader's coverage
def epoch_coverage(shards_dir: Path, method, *, global_batch: int, world_size: int, num_workers: int,
                   epoch_unit: str, epoch_samples: int, accum_steps: int) -> dict | None:
    """DEVELOPERS.md interface 2 (`clipfinetune.data.loader.epoch_coverage`, exact from the shards' index); None
    where the loader does not offer it."""
    try:
        from clipfinetune.data.loader import epoch_coverage as coverage
    except ImportError:
        return None
    return coverage(shards_dir, "train", method, global_batch=global_batch, world_size=world_size,
                    num_workers=num_workers, epoch_unit=epoch_unit, epoch_samples=epoch_samples,
                    accum_steps=accum_steps)


# --------------------------------------------------------------------------------------------- measured rates
def load_calibration(root: Path) -> list[dict]:
    path = Path(root) / CALIBRATION
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("figures", [])


def find_figure(figures: list[dict], device: str, what: str, arch: str = "", method: str = "",
                batch: int | None = None) -> dict | None:
    """The measured figure of `what` (train_step, segments, word_regions, ...) on this device kind (a figure's device
    name contained in it, case-insensitive: "H200" in "NVIDIA H200"), for this architecture and method (a figure
    naming none applies to all), and for a train_step at this per-rank batch (None: the large-batch rate)."""
    device = device.lower()
    for f in figures:
        if f["what"] == what and f.get("device") and f["device"].lower() in device \
                and f.get("arch", "") in ("", arch) and f.get("method", "") in ("", method) \
                and (batch is None or f.get("batch", LARGE_BATCH) == batch) \
                and (batch is not None or what != "train_step" or f.get("batch", LARGE_BATCH) >= LARGE_BATCH):
            return f
    return None


def _source(f: dict) -> str:
    return f"{f['value']:g} {f['unit']} on {f['device']} ({f['source']})"


@dataclass
class StepTime:
    seconds: float             # one optimizer step's micro-batch on one rank
    basis: str                 # measured | scaled
    how: str                   # from what, by what rule


def step_time(figures: list[dict], device: str, arch: str, method: str, batch: int) -> StepTime | None:
    """Seconds of one training step at `batch` per rank, from the method's large-batch rate and the latency floor
    (train_step figures at small batches, any method): at or above the large batch the per-sample rate holds
    (linear); below it the step time is interpolated between the measured batches, and under the smallest one it is
    that one's (a step cannot get cheaper than the card's latency). None when the method's rate was not measured."""
    top = find_figure(figures, device, "train_step", arch, method)
    if top is None:
        return None
    big = int(top.get("batch", LARGE_BATCH))
    points = {big: big / top["value"]}
    floor = [f for f in figures if f["what"] == "train_step" and f.get("device") and f["device"].lower()
             in device.lower() and f.get("arch", "") in ("", arch) and f.get("method", "") in ("", method)
             and f.get("batch", LARGE_BATCH) < big]
    for f in floor:
        points.setdefault(int(f["batch"]), int(f["batch"]) / f["value"])
    if batch == big:
        return StepTime(points[batch], "measured", _source(top))
    same = [f for f in floor if f["batch"] == batch]
    if same:                           # measured at this batch: this method's own step, or the card's latency floor
        own = any(f.get("method", "") == method for f in same)
        return StepTime(points[batch], "measured" if own else "scaled",
                        _source(same[0]) + ("" if own else f"; the latency floor at batch {batch}, taken for {method}"))
    if batch > big or len(points) == 1:
        rule = "x batch / " + str(big) + (" (linear: no smaller batch measured, a lower bound below ~32 per GPU)"
                                           if batch < big else " (linear above the measured batch)")
        return StepTime(batch * points[big] / big, "scaled", f"{_source(top)}; step time {rule}")
    sizes = sorted(points)
    if batch < sizes[0]:
        t = points[sizes[0]]
    else:
        lo = max(b for b in sizes if b < batch)
        hi = min(b for b in sizes if b > batch)
        t = points[lo] + (points[hi] - points[lo]) * (batch - lo) / (hi - lo)
    measured = ", ".join(f"batch {b}: {points[b] * 1000:.1f} ms" for b in sizes)
    return StepTime(t, "scaled", f"step time interpolated between the measured batches ({measured}; {_source(top)})")


class _Sizes:
    """Bytes of files and folders (walked once each)."""

    def __init__(self, root: Path):
        self.root, self.known = Path(root), {}

    def __call__(self, rel: str) -> int | None:
        path = Path(rel) if Path(rel).is_absolute() else self.root / rel
        if rel not in self.known:
            self.known[rel] = _walk(path) if path.exists() else None
        return self.known[rel]


def _walk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total, stack = 0, [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=True):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=True):
                    total += e.stat().st_size
    return total


class _Records:
    """Each source's records, read once (through its reader, as the stages read it)."""

    def __init__(self, params: dict, root: Path):
        self.params, self.root, self.known = params, Path(root), {}

    def __call__(self, name: str) -> list | None:
        if name not in self.known:
            import contextlib

            from clipfinetune.data.readers import read_source

            spec = (_get(self.params, "sources") or {}).get(name)
            try:
                with contextlib.chdir(self.root):
                    self.known[name] = read_source(name, spec) if spec else None
            except Exception:  # noqa: BLE001  a missing or bad file is validate's refusal, not a crash of the plan
                self.known[name] = None
        return self.known[name]


def _training_row(row, st, params, runs, compute, gpus, most, hardware, device, kind, figures, refusals, warnings,
                  records, shards_dir, sizes, root):
    row.kind = "training"
    run_name = st.args.get("run", st.name.split("@", 1)[-1])
    run = runs.get(run_name)
    if run is None:
        return
    train, method = run["train"], run["method"]
    row.method = method
    global_batch, accum = int(train["batch_size"]), int(train.get("accum_steps", 1))
    row.epochs = int(train["epochs"])
    if not _training_ranks(row, global_batch, accum, batch_param(params, method), compute, gpus, most, hardware,
                           device, refusals, warnings):
        return
    coverage = None
    if (shards_dir / "index.json").is_file():
        try:
            from clipfinetune.methods import get_method

            coverage = epoch_coverage(shards_dir, get_method(method)(**run["config"]), global_batch=global_batch,
                                      world_size=row.ranks, num_workers=host.count("train", row.ranks),
                                      epoch_unit=train.get("epoch_unit", "image"),
                                      epoch_samples=int(train.get("epoch_samples", 0) or 0), accum_steps=accum)
        except Exception as e:  # noqa: BLE001  shards of another configuration: the estimate below, said so
            row.notes.append(f"epoch_coverage failed on data/shards ({e}): estimated")
    if coverage is not None:
        row.units, row.seen, row.repeated = coverage["units"], coverage["seen"], coverage["repeated"]
        row.steps_per_epoch, row.coverage = coverage["steps_per_epoch"], "exact"
        if row.seen < row.units or row.repeated:
            refusals.append(Refusal(st.name, "shards.maxcount",
                                    f"an epoch sees {row.seen:,} of {row.units:,} units and repeats {row.repeated:,} "
                                    f"at {row.ranks} ranks x {host.count('train', row.ranks)} workers",
                                    ["a smaller shards.maxcount (more shards per reader)",
                                     "fewer loader workers (CLIPFINETUNE_WORKERS, docs/scale.md)"]))
    else:
        units = _estimated_units(params, run, records, root)
        if units is not None:
            row.units, row.seen, row.repeated, row.coverage = units, units, 0, "estimated"
            row.steps_per_epoch = math.ceil(units / global_batch)
        else:
            row.coverage = "unknown"
            row.notes.append("units unknown until its sources' records can be read (`dvc repro shards`, then plan "
                             "again: the loader's exact count)")
    if (sizes("models/base") or 0) and row.outputs_bytes is None:
        row.outputs_bytes, row.outputs_note = sizes("models/base"), "estimated (models/base's size)"
    arch = str(_get(params, "model.name"))
    _training_time(row, figures, kind, arch, method, accum, host.count("train", row.ranks))
    for f in figures:                  # the paper's own cost of a run (any card: the one the authors had)
        if f["what"] == "paper_run" and f.get("method") == method and f.get("arch", "") in ("", arch):
            row.paper = f"{f['value']:g} {f['unit']} per {f['per']} on one {f['device']} ({f['source']})"
            break


def _training_time(row, figures, kind, arch, method, accum, workers) -> None:
    """A training stage's time: steps x the step time at its per-rank micro-batch (`step_time`), each rank fed at
    most `workers` x the loader's measured rate per worker (a step faster than that waits for its data)."""
    if not row.rank_batch:
        return
    micro = row.rank_batch // accum
    row.latency_bound = row.device == "cuda" and micro < LATENCY_BOUND
    if not row.steps_per_epoch:
        return
    step = step_time(figures, kind, arch, method, micro)
    if step is None:
        return
    seconds, basis, how = step.seconds, step.basis, step.how
    loader = find_figure(figures, kind, "loader", arch) if workers else None
    if loader and micro / seconds > loader["value"] * workers:
        seconds, basis = micro / (loader["value"] * workers), "scaled"
        how += f"; loader-bound: {workers} workers x {_source(loader)}"
    elif not loader:
        how += "; the loader not counted (no rate measured for it here)"
    row.seconds = row.epochs * row.steps_per_epoch * accum * seconds
    row.basis, row.time_source = basis, f"{micro} per rank, {seconds * 1000:.1f} ms/step: {how}"


def _estimated_units(params: dict, run: dict, records, root: Path) -> int | None:
    """An epoch's units from the sources' records (before the shards exist): the records of `shards.sources` in
    `shards.splits` the method wants, counted in its unit (`train.epoch_unit`), capped by `epoch_samples`."""
    method = _method(run)
    if method is None:
        return None
    long = "long" in method.caption_kinds()
    splits = set(_get(params, "shards.splits") or [])
    wanted = []
    for name in _get(params, "shards.sources") or []:
        recs = records(name)
        if recs is None:
            return None
        wanted += [r for r in recs if (not r.split or r.split in splits)
                   and (bool(r.long_caption) if long else bool(r.captions))]
    units = len(wanted)
    if run["train"].get("epoch_unit") == "method":
        if method.units_table():                    # a prepared table's rows: counted once its stage has written it
            table = root / "data" / "prepared" / f"{method.units_table()}.parquet"
            if not table.is_file():
                return None
            import pyarrow.parquet as pq

            units = pq.ParquetFile(table).metadata.num_rows
        elif method.epoch_unit == "caption":
            units = sum(len(r.captions) for r in wanted)
    samples = int(run["train"].get("epoch_samples", 0) or 0)
    return min(units, samples) if samples else units


def _pretrain_row(row, params, compute, gpus, most, hardware, device, kind, figures, refusals, warnings, records):
    if _get(params, "model.pretrained"):
        row.kind, row.device = "export", "cpu"
        row.notes.append(f"model.pretrained={_get(params, 'model.pretrained')!r}: exported unchanged, one process")
        row.time_source = "seconds (an export)"
        return
    row.kind = "training"
    row.epochs = int(_get(params, "pretrain.epochs") or 0)
    global_batch = int(_get(params, "pretrain.batch_size") or 0)
    if not _training_ranks(row, global_batch, 1, "pretrain.batch_size", compute, gpus, most, hardware, device,
                           refusals, warnings):
        return
    images = 0
    for name in _get(params, "pretrain.sources") or []:
        recs = records(name)
        images += len(recs) if recs else 0
    if images:
        row.units, row.seen, row.repeated, row.coverage = images, images, 0, "estimated"
        row.steps_per_epoch = images // global_batch
    row.method = "clip"
    _training_time(row, figures, kind, str(_get(params, "model.name")), "clip", 1, 0)


def _item_row(row, st, params, gpus, most, hardware, device, kind, figures, records):
    row.kind, row.device = "items", device
    row.ranks, row.gpus = most * hardware.nodes, gpus[:most]
    source = st.args.get("source")
    if st.script == "stages/eval.py":
        sets = [f"{t}.{s}" for t, by in (_get(params, "eval.evalsets") or {}).items() for s, cfg in (by or {}).items()
                if cfg]
        row.items, row.items_what = len(sets), "benchmark sets"
        f = find_figure(figures, kind, "eval_images", str(_get(params, "model.name")))
        if f:
            row.time_source = f"unknown: the sets' images are not counted here ({_source(f)})"
        return
    recs = records(source) if source else None
    if recs is not None:
        row.items, row.items_what = len(recs), "images"
    if st.script == "stages/segments.py":
        sam = _get(params, "segments.sam_checkpoint")
        what = f"sam_{_get(params, 'segments.sam_type')}" if sam else "cpu_segmenter"
        f = find_figure(figures, kind, "segments", what)
        if f and row.items:
            row.seconds = row.items * f["value"] / row.ranks
            row.basis = "measured" if row.ranks == 1 else "scaled"
            row.time_source = _source(f) + (f"; / {row.ranks} ranks (independent images)" if row.ranks > 1 else "")
        elif not sam:
            row.notes.append("segments.sam_checkpoint empty: the CPU segmenter (scikit-image), not SAM")
    elif st.script == "stages/lism.py":
        f = find_figure(figures, kind, "lism_crops")
        if f:
            row.time_source = f"unknown: the crops per image are known once segments has run ({_source(f)})"


def _data_row(row, st, params, figures, records, sizes):
    base = st.name.split("@", 1)[0]
    source = st.args.get("source")
    recs = records(source) if source else None
    if base == "negatives" and recs is not None:
        from clipfinetune.data.negatives.degla.generate import FILL_TYPES
        from clipfinetune.data.negatives.degla.validators import TYPES

        captions = len({" ".join(c.split()) for r in recs for c in r.captions})
        row.items, row.items_what = captions, "unique captions"
        backend = _get(params, "negatives.backend")
        if backend != "rules":
            row.llm_requests = captions * len(TYPES)
            row.notes.append(f"{captions:,} captions x {len(TYPES)} rewrite types (+ up to {len(FILL_TYPES)} per "
                             f"caption short of negatives.per_caption {_get(params, 'negatives.per_caption')}); "
                             f"answers cached in {_get(params, 'negatives.cache_dir')}")
            row.device = "cpu (LLM: server)" if backend == "server" else "cuda (vLLM offline)"
    elif base in ("word_regions", "negatives") and recs is not None:
        row.items, row.items_what = sum(len(r.captions) for r in recs), "captions"
    elif base in ("sentences",) and recs is not None:
        row.items, row.items_what = len(recs), "descriptions"
    elif base == "shards":
        splits = set(_get(params, "shards.splits") or [])
        n, images = 0, 0
        for name in _get(params, "shards.sources") or []:
            rs = records(name) or []
            n += sum(1 for r in rs if not r.split or r.split in splits)
            spec = _get(params, f"sources.{name}") or {}
            images += sizes(spec["images"]) or 0 if spec.get("images") else 0
        row.items, row.items_what = n, "samples (at most)"
        if row.outputs_bytes is None and images:
            row.outputs_bytes, row.outputs_note = images, "estimated (the sources' image files, not re-encoded)"
    f = find_figure(figures, "cpu", base) if base in ("word_regions", "sentences") else None
    if f and row.items:
        row.seconds, row.basis = row.items / f["value"], "measured"
        row.time_source = _source(f)


def _latency_advice(rows, figures, kind, arch, gpus, nodes) -> list[str]:
    """Training stages whose per-rank batch leaves the GPUs latency-bound (under ~32: a step costs about what a
    tiny one does), with the better layout: the runs side by side on a share of the GPUs each, instead of one
    after another on all of them."""
    bound = [r for r in rows if r.latency_bound and r.ranks > 1]
    if not bound:
        return []
    names = ", ".join(r.stage for r in bound)
    floor = sorted((f["batch"], f["batch"] / f["value"] * 1000) for f in figures if f["what"] == "train_step"
                   and f.get("device") and f["device"].lower() in kind.lower() and f.get("batch", LARGE_BATCH) <
                   LATENCY_BOUND and f.get("arch", "") in ("", arch))
    measured = f" ({', '.join(f'batch {b}: {ms:.1f} ms' for b, ms in floor)} measured on {kind})" if floor else ""
    text = (f"{names}: {', '.join(sorted({str(r.rank_batch) for r in bound}))} per GPU is latency-bound: a step "
            f"costs about as much as at the smallest batch{measured}, so {max(r.ranks for r in bound)} GPUs "
            "train a run "
            f"little faster than one")
    share = len(gpus) // len(bound) if len(bound) > 1 else 1
    if len(bound) > 1 and share >= 1:
        now = [r.seconds for r in bound]
        side = []
        for r in bound:
            k = next((k for k in range(share, 0, -1) if r.global_batch % (k * nodes) == 0), 1)
            step = step_time(figures, kind, arch, r.method, r.global_batch // (k * nodes))
            side.append(None if step is None or r.seconds is None else
                        r.epochs * r.steps_per_epoch * step.seconds)
        timing = (f": about {_fmt_seconds(max(side))} for all instead of {_fmt_seconds(sum(now))}"
                  if None not in side and None not in now else "")
        text += (f". Better: the {len(bound)} runs side by side on {share} GPU(s) each (compute.train_nproc: "
                 f"{share}, each run's experiment given its own {share} cards with CUDA_VISIBLE_DEVICES; the GPU "
                 f"locks keep concurrent stages off each other's cards){timing}")
    else:
        text += (". Better: compute.train_nproc: 1, and the other GPUs for other work (another experiment given "
                 "its own cards with CUDA_VISIBLE_DEVICES; the GPU locks keep concurrent stages off "
                 "each other's cards)")
    return [text]
