"""Rank metrics shared by every task: negatives ahead of a query's best positive (recall@K), top-K hits, mean
per-class accuracy, AP@K.

Tie rule (one rule for every ranked metric in this package): a candidate that scores *exactly* the
same as the best positive is ranked **ahead** of it when it is a negative, and ties among positives
do not matter. So a query is a hit at K iff fewer than K negatives score >= its best positive
("ties count against the model"). A constant model therefore scores 0 (chance-free), never 100, and
the result never depends on the order of the candidates (BLIP's `argsort[::-1]` does). The pairwise
compositional tests follow their official scripts instead (see `compositionality.py`).
"""
from __future__ import annotations

import numpy as np
import torch


def _as_np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def negatives_ahead(scores, positives, chunk: int = 1024) -> np.ndarray:
    """For each query row: how many negatives score >= the best positive. [Q] ints.

    scores [Q, C] float, positives [Q, C] bool (every row needs >= 1 positive).
    """
    scores, positives = _as_np(scores), _as_np(positives).astype(bool)
    if scores.shape != positives.shape:
        raise ValueError(f"scores {scores.shape} and positives {positives.shape} differ")
    if not positives.any(axis=1).all():
        raise ValueError("every query needs at least one positive")
    out = np.empty(scores.shape[0], dtype=np.int64)
    for s in range(0, scores.shape[0], chunk):
        sc, pos = scores[s:s + chunk], positives[s:s + chunk]
        best = np.where(pos, sc, -np.inf).max(axis=1, keepdims=True)
        out[s:s + chunk] = ((sc >= best) & ~pos).sum(axis=1)
    return out


def topk_hits(logits, labels, k: int) -> np.ndarray:
    """[N] bool: the true class is in the top k (same tie rule: a tied wrong class ranks first)."""
    logits, labels = _as_np(logits), _as_np(labels).astype(np.int64)
    pos = np.zeros(logits.shape, dtype=bool)
    pos[np.arange(len(labels)), labels] = True
    return negatives_ahead(logits, pos) < k


def mean_per_class(hits, labels) -> float:
    """Mean over the classes present in `labels` of the per-class hit rate (CLIPSelf mAcc, balanced acc)."""
    hits, labels = _as_np(hits).astype(np.float64), _as_np(labels)
    classes = np.unique(labels)
    return 100.0 * float(np.mean([hits[labels == c].mean() for c in classes]))


def average_precision_at_k(scores, relevant, k: int) -> np.ndarray:
    """GOAL's `compute_ap` per query row: walk the top k, on each hit add hits/(rank+1); divide by |rel|.

    Normalised by the total number of relevant items (not min(k, |rel|)), as GOAL codes it.
    Ordering: score descending, ties put negatives first (the package tie rule).
    """
    scores, relevant = _as_np(scores), _as_np(relevant).astype(bool)
    out = np.zeros(scores.shape[0], dtype=np.float64)
    for q in range(scores.shape[0]):
        # lexsort: last key primary -> by -score, then relevant (False=0 first)
        order = np.lexsort((relevant[q].astype(np.int8), -scores[q]))[:k]
        hits = relevant[q][order]
        ranks = np.flatnonzero(hits)
        out[q] = float(np.sum(np.arange(1, len(ranks) + 1) / (ranks + 1)) / relevant[q].sum())
    return out
