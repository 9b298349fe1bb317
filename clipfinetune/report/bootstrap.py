"""Paired bootstrap over test items (Efron & Tibshirani 1993, percentile interval).

Each stratum (one scored list of a benchmark, e.g. SugarCrepe's replace_obj file) is resampled with
replacement on its own, B times; a resample is a function of (seed, stratum name, stratum size) alone, so
every model, every claim and every run draws the SAME item indices for the same list: the difference of two
models is bootstrapped on paired items, and a statistic over several lists (a mean of files, a difference of
differences) sees one consistent resample of each.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95


def resample_indices(n: int, n_resamples: int, seed: int, stratum: str) -> np.ndarray:
    """[n_resamples, n] item indices drawn with replacement; deterministic in (seed, stratum, n)."""
    if n < 1:
        raise ValueError(f"stratum {stratum!r} has no items")
    rng = np.random.default_rng([int(seed), zlib.crc32(stratum.encode()), int(n)])
    return rng.integers(0, n, size=(int(n_resamples), int(n)))


def paired_bootstrap(sizes: dict[str, int], statistic: Callable[[dict[str, np.ndarray]], np.ndarray],
                     n_resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict:
    """Percentile CI of `statistic` over item resamples.

    sizes: {stratum: number of items}; statistic: {stratum: index array [B, n]} -> [B] values (it gathers
    every model's per-item outcomes with the same indices and returns e.g. method - baseline).
    Returns {"estimate": statistic on the items as they are, "low", "high", "n_resamples", "level"}.
    """
    point = statistic({s: np.arange(n)[None, :] for s, n in sizes.items()})
    boot = np.asarray(statistic({s: resample_indices(n, n_resamples, seed, s) for s, n in sizes.items()}),
                      dtype=np.float64)
    if boot.shape != (n_resamples,):
        raise ValueError(f"statistic returned shape {boot.shape}, expected ({n_resamples},)")
    tail = 100.0 * (1.0 - level) / 2.0
    low, high = np.percentile(boot, [tail, 100.0 - tail])
    return {"estimate": float(np.asarray(point).reshape(-1)[0]), "low": float(low), "high": float(high),
            "n_resamples": int(n_resamples), "level": float(level)}
