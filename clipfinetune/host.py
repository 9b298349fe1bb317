"""Worker and thread counts: the host's to choose, never a DVC param. They change how fast a stage runs, not what it
writes (the loader's batches, LISM's matches and the evaluation's items are the same for any count: tests), so
setting them for a host's cores re-runs nothing (docs/scale.md, "Worker and thread counts").

Each count defaults to what the host offers one rank: the CPU cores this process may use divided by the ranks on
this host (torchrun's LOCAL_WORLD_SIZE; 1 outside it), capped at CAP. An environment variable sets it per host
(`VARIABLES`; 0 = no worker processes, everything in the rank's own process). The older params keys
(`train.workers`, `eval.workers`, `eval.threads`, `lism.workers`) are read by no stage.
"""
from __future__ import annotations

import os

CAP = 12      # an 8-GPU node's 96-128 cores over its 8 ranks
VARIABLES = {
    "train": "CLIPFINETUNE_WORKERS",              # the training loader's DataLoader workers per rank (train@, pretrain)
    "eval": "CLIPFINETUNE_EVAL_WORKERS",          # eval@/eval_base: DataLoader workers decoding images per rank
    "eval_threads": "CLIPFINETUNE_EVAL_THREADS",  # eval@/eval_base: torch CPU threads per rank
    "lism": "CLIPFINETUNE_LISM_WORKERS",          # lism@: DataLoader workers decoding images and cutting crops
}


def cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or a scheduler's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:            # not on Linux
        return os.cpu_count() or 1


def ranks_on_host() -> int:
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))


def default_count(ranks: int | None = None) -> int:
    """Cores per rank on this host (`ranks` on it, default `ranks_on_host()`), at least 1, at most CAP."""
    return max(1, min(CAP, cores() // max(1, ranks or ranks_on_host())))


def count(kind: str, ranks: int | None = None) -> int:
    """The count of `kind` (a key of VARIABLES) for a rank: its environment variable where set, else
    `default_count(ranks)` (`ranks`: a planned number of ranks on this host; default: this process's).
    A value that is no whole number >= 0 fails naming the variable."""
    name = VARIABLES[kind]
    value = os.environ.get(name, "").strip()
    if not value:
        return default_count(ranks)
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"environment variable {name}={value!r}: a count of {kind} workers or threads is a whole "
                         "number >= 0 (0: none, the rank's own process)")
    return n


def settings() -> dict[str, int]:
    """Every count as this rank sees it (for a stage's log)."""
    return {kind: count(kind) for kind in VARIABLES}
