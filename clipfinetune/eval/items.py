"""Per-item outcomes of the evaluation suite, and every aggregate metric recomputed from them.

One row per (benchmark, part, item): `benchmark` is the metric prefix (`retrieval.sample`,
`compositionality.sugarcrepe.sample`), `part` one scored list of it (`i2t`, `t2i`, a SugarCrepe file, `top1`),
`item` a stable id (image path, file key, list index) so two models' rows pair exactly, `kind` says what
`value` holds, and `label` the group of a macro average (class, ARO relation; empty when the item is in no
group of it):
  rank     1-based rank of the first correct candidate (retrieval I->T / T->I); R@K = mean(rank <= K)
  correct  1.0 / 0.0 (top-k hit, compositional test case); the metric is the mean
  ap       average precision of the query (global-local AP@10); mAP = mean
Aggregates are percent, as in metrics/<model>.json. `statistic` turns a metric key into a function of
resampled item indices, which is what the report's paired bootstrap needs.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

COLUMNS = ("benchmark", "part", "item", "kind", "value", "label")
KINDS = ("rank", "correct", "ap")
METRICS_KEY = "metrics.json"   # the eval stage's parquet schema metadata: its metrics/<model>.json text (stage `report`
                               # depends on metrics/items alone, so either file's change re-runs it)


@dataclass
class Items:
    """One scored list of a benchmark, as an evaluator reports it."""
    part: str
    kind: str
    ids: list[str]
    values: np.ndarray
    labels: list[str] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"item kind must be one of {KINDS}, got {self.kind!r}")
        self.values = np.asarray(self.values, dtype=np.float64)
        if len(self.ids) != len(self.values) or (self.labels is not None and len(self.labels) != len(self.ids)):
            raise ValueError(f"part {self.part!r}: ids, values and labels differ in length")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError(f"part {self.part!r}: item ids are not unique")


def record(sink: list | None, *items: Items) -> None:
    """Evaluators take an optional `items` list and append their per-item outcomes to it."""
    if sink is not None:
        sink.extend(items)


def to_frame(rows: list[tuple[str, Items]]):
    """[(benchmark, Items)] -> one table with COLUMNS (the eval stage's parquet)."""
    import pandas as pd

    cols = {c: [] for c in COLUMNS}
    for benchmark, it in rows:
        n = len(it.ids)
        cols["benchmark"] += [benchmark] * n
        cols["part"] += [it.part] * n
        cols["item"] += list(it.ids)
        cols["kind"] += [it.kind] * n
        cols["value"] += it.values.tolist()
        cols["label"] += [""] * n if it.labels is None else [str(x) if x is not None else "" for x in it.labels]
    return pd.DataFrame(cols).astype({"value": "float64"})


@dataclass
class Part:
    """One part of one model, items sorted by id (so that two models' parts align)."""
    ids: np.ndarray
    values: np.ndarray
    labels: np.ndarray
    kind: str


def parts_of(frame) -> dict[tuple[str, str], Part]:
    """{(benchmark, part): Part} from a COLUMNS table."""
    out = {}
    for (bench, part), g in frame.groupby(["benchmark", "part"], sort=False):
        g = g.sort_values("item", kind="stable")
        out[(bench, part)] = Part(g["item"].to_numpy(dtype=object), g["value"].to_numpy(dtype=np.float64),
                                  g["label"].to_numpy(dtype=object), str(g["kind"].iloc[0]))
    return out


# ------------------------------------------------------------------ statistics over (resampled) items
def _rate(part: Part, idx: np.ndarray, k: int | None = None) -> np.ndarray:
    v = part.values[idx]
    return 100.0 * ((v <= k) if part.kind == "rank" else v).mean(axis=-1)


def _macro(part: Part, idx: np.ndarray) -> np.ndarray:
    """Mean over the groups present in each resample of the group's mean; items labelled "" are left out."""
    v, lab = part.values[idx], part.labels[idx]
    accs = []
    for g in sorted(set(part.labels.tolist()) - {""}):
        m = lab == g
        cnt = m.sum(axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):
            accs.append(np.where(cnt > 0, (v * m).sum(axis=-1) / np.maximum(cnt, 1), np.nan))
    if not accs:
        raise ValueError("macro average over no groups")
    return 100.0 * np.nanmean(np.stack(accs), axis=0)


@dataclass
class Statistic:
    """A metric as a function of item indices: `fn({part key: idx [..., n]}) -> [...]`."""
    parts: list[tuple[str, str]]
    fn: Callable[[dict, dict], np.ndarray]        # (parts of one model, {part key: idx}) -> values


def _one(key, fn) -> Statistic:
    return Statistic([key], lambda parts, idx: fn(parts[key], idx[key]))


def statistic(metric: str, available) -> Statistic:
    """The Statistic of a dotted metric key (e.g. `retrieval.sample.i2t_r1`, `compositionality.sugarcrepe.
    sample.mean`); `available`: the (benchmark, part) keys one model's items hold. KeyError when the metric has
    no per-item form here (or its items are absent)."""
    bench, _, name = metric.rpartition(".")
    task = bench.split(".")[1] if bench.startswith("compositionality.") else bench.split(".")[0]
    mine = [p for b, p in available if b == bench]
    if not mine:
        raise KeyError(f"no per-item outcomes for {bench}")

    def need(part):
        if part not in mine:
            raise KeyError(f"no per-item outcomes for {bench} part {part!r}")
        return (bench, part)

    if task in ("retrieval", "long_retrieval"):
        m = re.fullmatch(r"(i2t|t2i)_r(\d+)", name)
        if m:
            return _one(need(m[1]), lambda p, i, k=int(m[2]): _rate(p, i, k))
    elif task == "global_local":
        m = re.fullmatch(r"(i2t|t2i)_map\d+(_as_shipped)?", name)
        if m:
            return _one(need(m[1] + (m[2] or "")), _rate)
    elif task in ("box_cls", "box_cls_hard", "zeroshot"):
        m = re.fullmatch(r"(?:top|acc|macc)(\d)|mean_per_class", name)
        if m:
            part = need(f"top{m[1] or 1}")
            return _one(part, _macro if name.startswith("macc") or name == "mean_per_class" else _rate)
    elif task in ("sugarcrepe", "valse") and name == "mean":
        keys = [need(p) for p in mine]
        return Statistic(keys, lambda parts, idx: np.mean([_rate(parts[k], idx[k]) for k in keys], axis=0))
    elif task == "aro" and name in ("vg_relation", "vg_attribution"):
        return _one(need(name), _macro)
    elif task == "aro" and name.endswith("_micro"):
        return _one(need(name.removesuffix("_micro")), _rate)
    elif task in ("sugarcrepe", "valse", "aro", "winoground") and name in mine:
        return _one(need(name), _rate)
    raise KeyError(f"metric {metric} has no per-item form")


def recompute(frame, metric: str) -> float:
    """The aggregate value of `metric` from one model's items (equals metrics/<model>.json's)."""
    parts = parts_of(frame)
    st = statistic(metric, parts)
    return float(st.fn(parts, {k: np.arange(len(parts[k].ids)) for k in st.parts}))
