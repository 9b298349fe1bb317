"""The whole evaluation suite on one model: benchmark configs in, one nested metrics dict out.

`evalsets` has the shape of params.yaml `eval.evalsets`: {task: {set name: {paths...}}}. A task or
set that is missing or empty is skipped and listed under `"skipped"` (never silently); a configured
benchmark whose files are missing is an error naming the file. Output keys (percent, 0-100):
  retrieval.<set>.{i2t,t2i}_r{1,5,10}          long_retrieval.<set>.{i2t,t2i}_r{1,5,25,50}
  global_local.<set>.{i2t,t2i}_map10[_as_shipped]
  box_cls.<set>, box_cls_hard.<set>.{top1,top5,macc1,macc5}
  compositionality.sugarcrepe.<set>.{<7 tasks>,mean}
  compositionality.aro.<set>.{vg_relation,vg_attribution,coco_order}
  compositionality.valse.<set>.{<piece>,mean}          compositionality.winoground.<set>.{text,image,group}
  zeroshot.<set>.{acc1,acc5,mean_per_class}
Reading a set is `clipfinetune.data.evalsets.sets.read_set` (task -> its reader), shared with the leakage check and
the evaluation-set manifest of stage `evalsets`.
"""
from __future__ import annotations

import logging
import time

from clipfinetune.data.evalsets.sets import ARO_ORDERS, read_set
from clipfinetune.eval import aro_order, box_cls, global_local, long_retrieval, retrieval, zeroshot
from clipfinetune.eval import compositionality as comp
from clipfinetune.eval.encode import PROTOCOL_RESIZE, Encoder

log = logging.getLogger(__name__)

TASKS = ("retrieval", "long_retrieval", "global_local", "box_cls", "box_cls_hard",
         "sugarcrepe", "aro", "valse", "winoground", "zeroshot")
COMPOSITIONAL = {"sugarcrepe", "aro", "valse", "winoground"}


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


def evaluate_model(model, evalsets: dict | None, batch_size: int = 128, text_model=None,
                   text_encoder: str = "own", aro_seed: int = 1, cache_dir=None, items: list | None = None,
                   encoders: tuple[Encoder, Encoder] | None = None) -> dict:
    """Run every configured benchmark. `text_model` (e.g. the base model) scores box classes when
    `text_encoder == "base"`; the choice is recorded under meta. `cache_dir`: where model-independent
    preprocessing (ARO-Order's POS tags) persists between models; None recomputes it. `items`, when given,
    receives (metric prefix, Items) for every scored list: `clipfinetune.eval.items.to_frame` tabulates them.
    `encoders`: `make_encoders`' pair to use (e.g. with caches filled by eval/sharded.py); default new ones."""
    evalsets = evalsets or {}
    enc, text_enc = encoders or make_encoders(model, text_model, text_encoder, batch_size)
    metrics: dict = {"skipped": {}, "meta": {"box_cls_text_encoder": text_encoder}}
    skipped = metrics["skipped"]
    unknown = set(evalsets) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown benchmark tasks in config: {sorted(unknown)} (known: {TASKS})")
    for task in TASKS:
        sets = evalsets.get(task) or {}
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
