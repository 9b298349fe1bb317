"""GOAL's global-local mAP@10 (`mAP_goal_jointtest.py`, docs/evalsets.md §7) in two modes.

Test list (docs/evalsets.md §7.1, written by the `lism` stage, read by `clipfinetune.data.evalsets.global_local`):
global and local records, grouped by image.

* mode "linked" (the intended protocol; reported as the headline): I2T - a global query's relevant
  captions are its own and its locals'; a local query's are its own and its global's. T2I (one query
  per unique caption) mirrors it with images.
* mode "as_shipped": GOAL's code as published, whose basename-vs-full-path lookups never match, so
  every query's only relevant item is its own pair (relevant = same caption string).
AP@k = sum over hits in the top k of hits/(rank+1), divided by |relevant| (GOAL's normalisation);
ties rank negatives first (`ranking.py`). Reported x100.
"""
from __future__ import annotations

import numpy as np

from clipfinetune.data.evalsets.global_local import JointRecord
from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.ranking import average_precision_at_k


def relevance(records: list[JointRecord], mode: str) -> np.ndarray:
    """[R, R] bool: image of record i is relevant to caption of record j (and vice versa)."""
    n = len(records)
    caps = np.array([r.caption for r in records], dtype=object)
    same_caption = caps[:, None] == caps[None, :]
    if mode == "as_shipped":
        return same_caption
    if mode != "linked":
        raise ValueError(f"mode must be linked|as_shipped, got {mode!r}")
    groups = np.array([r.group for r in records], dtype=object)
    local = np.array([r.is_local for r in records])
    same_group = groups[:, None] == groups[None, :]
    # global <-> every member of its group; local <-> itself and its group's global(s)
    linked = same_group & (~local[:, None] | ~local[None, :])
    return linked | same_caption | np.eye(n, dtype=bool)


def ap_per_query(sims: np.ndarray, records: list[JointRecord], mode: str, k: int = 10):
    """AP@k of every I2T query (one per record) and every T2I query (one per unique caption, first record
    carrying it): (i2t [R], t2i [U], t2i query record indices [U])."""
    rel = relevance(records, mode)
    i2t = average_precision_at_k(sims, rel, k)
    caps = [r.caption for r in records]
    first = list(dict.fromkeys(caps))
    cols = [caps.index(c) for c in first]
    rel_t2i = np.stack([rel[:, j] for j in cols])              # [U, R]: images relevant to caption
    return i2t, average_precision_at_k(sims[:, cols].T, rel_t2i, k), cols


def evaluate_global_local(encoder: Encoder, records: list[JointRecord], k: int = 10, items: list | None = None) -> dict:
    """Items: parts i2t / t2i (linked) and i2t_as_shipped / t2i_as_shipped; a query's id is its record's index
    in the list and its group (T2I: the first record carrying the caption)."""
    img = encoder.images([r.image for r in records])
    txt = encoder.texts([r.caption for r in records])
    sims = (img @ txt.T).numpy()
    ids = [f"{i:06d}:{r.group}" for i, r in enumerate(records)]
    out = {}
    for mode, suffix in (("linked", ""), ("as_shipped", "_as_shipped")):
        i2t, t2i, cols = ap_per_query(sims, records, mode, k)
        record(items, Items(f"i2t{suffix}", "ap", ids, i2t), Items(f"t2i{suffix}", "ap", [ids[j] for j in cols], t2i))
        out[f"i2t_map{k}{suffix}"], out[f"t2i_map{k}{suffix}"] = 100.0 * float(i2t.mean()), 100.0 * float(t2i.mean())
    return {**out, "n_records": len(records), "n_local": sum(r.is_local for r in records)}
