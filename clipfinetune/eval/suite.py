"""The whole evaluation suite on one model: benchmark configs in, one nested metrics dict out.

`benchmarks` has the shape of params.yaml `eval.benchmarks`: {task: {set name: {paths...}}}. A task or
set that is missing or empty is skipped and listed under `"skipped"` (never silently); a configured
benchmark whose files are missing is an error naming the file. Output keys (percent, 0-100):
  retrieval.<set>.{i2t,t2i}_r{1,5,10}          long_retrieval.<set>.{i2t,t2i}_r{1,5,25,50}
  global_local.<set>.{i2t,t2i}_map10[_as_shipped]
  box_cls.<set>, box_cls_hard.<set>.{top1,top5,macc1,macc5}
  compositionality.sugarcrepe.<set>.{<7 tasks>,mean}   compositionality.aro.<set>.{vg_relation,vg_attribution,coco_order}
  compositionality.valse.<set>.{<piece>,mean}          compositionality.winoground.<set>.{text,image,group}
  zeroshot.<set>.{acc1,acc5,mean_per_class}
Reading a set is `read_set` (task -> its reader), shared with the leakage check; `benchmark_files` and
`benchmark_manifest` list what each set reads for stage `benchmarks`, on which every eval@<model> depends.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipfinetune.eval import aro_order, box_cls, global_local, long_retrieval, retrieval, zeroshot
from clipfinetune.eval import compositionality as comp
from clipfinetune.eval.encode import PROTOCOL_RESIZE, Encoder
from clipfinetune.io import InputError

log = logging.getLogger(__name__)

TASKS = ("retrieval", "long_retrieval", "global_local", "box_cls", "box_cls_hard",
         "sugarcrepe", "aro", "valse", "winoground", "zeroshot")
COMPOSITIONAL = {"sugarcrepe", "aro", "valse", "winoground"}


ARO_ORDERS = ("coco_order", "flickr_order")


@dataclass(frozen=True)
class BenchmarkSet:
    """One configured set as its benchmark's own reader gives it: `data` for the task's evaluator, `images` every image
    file it scores."""
    data: Any
    images: list[str]


def read_set(task: str, cfg: dict, name: str = "") -> BenchmarkSet:
    """Read one configured set (`eval.benchmarks.<task>.<name>`) with its benchmark's reader: the one place that says
    which reader each task uses. The evaluation (`run_benchmark`), the leakage check (`clipfinetune.leakage`) and the
    benchmark manifest (`benchmark_files`) all read sets through it, so they see the same files."""
    if task == "retrieval":
        data = retrieval.load_retrieval_set(cfg)
        return BenchmarkSet(data, data.images)
    if task == "long_retrieval":
        data = long_retrieval.load_long_set(cfg)
        return BenchmarkSet(data, data.images)
    if task == "global_local":
        data = global_local.read_joint_list(cfg["test_list"], cfg.get("images"))
        return BenchmarkSet(data, [r.image[0] for r in data])
    if task in ("box_cls", "box_cls_hard"):
        data = box_cls.load_box_set(cfg)
        return BenchmarkSet(data, [p for p, _ in data.images])
    if task in ("sugarcrepe", "valse"):
        read = comp.read_sugarcrepe if task == "sugarcrepe" else comp.read_valse
        data = read(cfg["dir"], cfg.get("images"))
        return BenchmarkSet(data, [r["image"] for recs in data.values() for r in recs])
    if task == "winoground":
        data = comp.read_winoground(cfg["dir"])
        return BenchmarkSet(data, [p for r in data for p in r["images"]])
    if task == "zeroshot":           # a multi-dataset templates.json is keyed by the set's name
        data = zeroshot.read_image_folder(cfg["dir"], cfg.get("split", "test"), cfg.get("templates_key", name))
        return BenchmarkSet(data, data.images)
    if task == "aro":
        data = {}
        if cfg.get("dir"):
            data["vg"] = comp.read_vg(cfg["dir"], cfg.get("images") or str(Path(cfg["dir"]) / "images"))
        data.update({order: retrieval.read_blip_list(cfg[order], cfg.get(f"{order}_images"))
                     for order in ARO_ORDERS if cfg.get(order)})
        images = [p for _, keys in data.get("vg", {}).values() for p, _ in keys]
        return BenchmarkSet(data, images + [p for order in ARO_ORDERS if order in data for p in data[order].images])
    raise ValueError(f"unknown evaluation task {task!r}")


def _aro(enc: Encoder, data: dict, cfg: dict, seed: int, skipped: dict, where: str, cache_dir=None,
         items=None) -> dict:
    out = {}
    if "vg" in data:
        out.update(comp.evaluate_vg(enc, data["vg"], int(cfg.get("vga_min_count", comp.VGA_MIN_COUNT)), items))
    for name in ARO_ORDERS:
        if name in data:
            tagger = aro_order.cached_tagger(cache_dir) if cache_dir else None
            cases = aro_order.build_order_cases(data[name], seed=int(cfg.get("order_seed", seed)), tagger=tagger)
            res = aro_order.evaluate_order(enc, cases, name, items)
            out[name], out[f"n_{name}"] = res["precision_at_1"], res["n"]
        else:
            skipped[f"{where}.{name}"] = "not configured"
    return out


def run_benchmark(task: str, cfg: dict, enc: Encoder, text_enc: Encoder, skipped: dict, where: str,
                  aro_seed: int = 1, cache_dir=None, items: list | None = None) -> dict:
    """One benchmark set's metrics; its per-item outcomes (clipfinetune.eval.items.Items) go to `items`."""
    data = read_set(task, cfg, where.rsplit(".", 1)[-1]).data
    if task == "retrieval":
        return retrieval.evaluate_retrieval(enc, data, items=items)
    if task == "long_retrieval":
        return long_retrieval.evaluate_long_retrieval(enc, data, items=items)
    if task == "global_local":
        return global_local.evaluate_global_local(enc, data, items=items)
    if task in ("box_cls", "box_cls_hard"):
        return box_cls.evaluate_box_cls(enc, data, text_enc, items)
    if task == "sugarcrepe":
        return comp.evaluate_sugarcrepe(enc, data, items)
    if task == "aro":
        return _aro(enc, data, cfg, aro_seed, skipped, where, cache_dir, items)
    if task == "valse":
        return comp.evaluate_valse(enc, data, items)
    if task == "winoground":
        return comp.evaluate_winoground(enc, data, items)
    return zeroshot.evaluate_zeroshot(enc, data, items)         # read_set refused any other task


def _is_image_root(key: str) -> bool:
    return key == "images" or key.endswith("_images")


def benchmark_files(task: str, cfg: dict, name: str = "") -> list[str]:
    """Every file one configured set reads: the images its reader scores (`read_set`), and each configured path that is
    not an image root (`images`, `<x>_images`): an annotation file, or every file under an annotation folder
    (SugarCRepe's `dir`, ARO's, a zero-shot folder's class names and templates). Image files under such a folder count
    only when scored, so a zero-shot folder's other splits or ARO's unused images are not read."""
    scored = [os.path.normpath(p) for p in read_set(task, cfg, name).images]
    files, scored_set = set(scored), set(scored)
    for key, value in cfg.items():
        if _is_image_root(key) or not isinstance(value, str) or not value:
            continue
        path = Path(value)
        if path.is_file():
            files.add(os.path.normpath(value))
        elif path.is_dir():
            for f in path.rglob("*"):
                p = os.path.normpath(f)
                if f.is_file() and (f.suffix.lower() not in zeroshot.IMAGE_EXTS or p in scored_set):
                    files.add(p)
    return sorted(files)


def benchmark_manifest(benchmarks: dict | None, cache_dir=None) -> tuple[dict, dict]:
    """({"<task>.<set>": {file: [size, BLAKE2b]}} for every configured set of `eval.benchmarks`, what it cost:
    {"files", "bytes", "files_hashed", "digests_reused"}). Digests are cached by (path, size, mtime) in
    `<cache_dir>/digests.sqlite` (`clipfinetune.leakage.DigestCache`, shared with the leakage check), so an unchanged
    set costs one stat per file. A set whose files are missing is an error naming the file."""
    from clipfinetune.leakage import DigestCache

    sets: dict[str, dict] = {}
    cache = DigestCache(cache_dir)
    try:
        for task, by_set in sorted((benchmarks or {}).items()):
            for name, cfg in sorted((by_set or {}).items()):
                if not cfg:
                    continue
                entry = sets[f"{task}.{name}"] = {}
                for path in benchmark_files(task, dict(cfg), name):
                    try:
                        st = os.stat(path)
                    except OSError as e:
                        raise InputError(path, f"eval.benchmarks.{task}.{name}", f"cannot read: {e}") from e
                    entry[path] = [st.st_size, cache.digest(path, st)]
        cost = {"files": sum(len(e) for e in sets.values()),
                "bytes": sum(size for e in sets.values() for size, _ in e.values()),
                "files_hashed": cache.hashed, "digests_reused": cache.reused}
    finally:
        cache.close()
    return sets, cost


def make_encoders(model, text_model=None, text_encoder: str = "own", batch_size: int = 128,
                  new=lambda model, batch_size, tag: Encoder(model, batch_size)) -> tuple[Encoder, Encoder]:
    """(the evaluated model's encoder, the box classes' text encoder): `text_model`'s when `text_encoder ==
    "base"`, else the same one. `new(model, batch_size, tag)` builds each ("model" / "text_model")."""
    enc = new(model, batch_size, "model")
    if text_encoder == "base":
        if text_model is None:
            raise ValueError("box_cls text_encoder 'base' needs the base model")
        return enc, new(text_model, batch_size, "text_model")
    if text_encoder == "own":
        return enc, enc
    raise ValueError(f"box_cls text_encoder must be own|base, got {text_encoder!r}")


def evaluate_model(model, benchmarks: dict | None, batch_size: int = 128, text_model=None,
                   text_encoder: str = "own", aro_seed: int = 1, cache_dir=None, items: list | None = None,
                   encoders: tuple[Encoder, Encoder] | None = None) -> dict:
    """Run every configured benchmark. `text_model` (e.g. the base model) scores box classes when
    `text_encoder == "base"`; the choice is recorded under meta. `cache_dir`: where model-independent
    preprocessing (ARO-Order's POS tags) persists between models; None recomputes it. `items`, when given,
    receives (metric prefix, Items) for every scored list: `clipfinetune.eval.items.to_frame` tabulates them.
    `encoders`: `make_encoders`' pair to use (e.g. with caches filled by eval/sharded.py); default new ones."""
    benchmarks = benchmarks or {}
    enc, text_enc = encoders or make_encoders(model, text_model, text_encoder, batch_size)
    metrics: dict = {"skipped": {}, "meta": {"box_cls_text_encoder": text_encoder}}
    skipped = metrics["skipped"]
    unknown = set(benchmarks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown benchmark tasks in config: {sorted(unknown)} (known: {TASKS})")
    for task in TASKS:
        sets = benchmarks.get(task) or {}
        if not sets:
            skipped[task] = "not configured"
            continue
        for name, cfg in sets.items():
            where = f"compositionality.{task}.{name}" if task in COMPOSITIONAL else f"{task}.{name}"
            if not cfg:
                skipped[where] = "not configured"
                continue
            t0 = time.perf_counter()
            found: list = []
            res = run_benchmark(task, dict(cfg), enc.with_resize(PROTOCOL_RESIZE[task]), text_enc, skipped, where,
                                aro_seed, cache_dir, found)
            if items is not None:
                items.extend((where, it) for it in found)
            log.info("%s: %.1fs %s", where, time.perf_counter() - t0,
                     {k: round(v, 2) for k, v in res.items() if isinstance(v, float)})
            node = metrics.setdefault("compositionality", {}).setdefault(task, {}) if task in COMPOSITIONAL \
                else metrics.setdefault(task, {})
            node[name] = res
    return metrics
