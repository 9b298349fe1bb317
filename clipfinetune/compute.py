"""How many ranks each kind of model stage takes, and on which GPUs: the rules of params `compute` (the hardware).

`compute` describes the machine, not the experiment: no stage declares it in dvc.yaml (stages/_common.py reads it from
params.yaml itself), so a change of GPUs or ranks re-runs nothing. That is sound because what a stage computes does not
depend on it: the item stages (segments, lism, eval) produce the same bytes at any rank count, and training's global
batch (`train.batch_size`, the papers' number) is the same at any count (each rank takes an equal share of it).

Settings (`settings()` checks them and fills the defaults):
- `device`: auto (cuda:LOCAL_RANK when CUDA is present, else the CPU) | cpu | cuda.
- `nproc`: ranks per node of the item stages and the most any stage takes: auto = every GPU the ranks may use (1 on
  the CPU); N = N (gloo ranks on the CPU).
- `train_nproc`: training's ranks per node (pretrain from scratch, train@<run>): auto = the largest count <= `nproc`
  that splits the run's global batch evenly (with `accum_steps` micro-batches per rank, and on M nodes the same count
  on each node); the other GPUs idle and `clipfinetune plan` names them and the batch sizes that would use them. N = N,
  an error naming the values that work when N does not split the batch.
- `llm_gpus`: GPUs kept for a vLLM server on this host (the LAST N visible ones; start the server with
  CUDA_VISIBLE_DEVICES set to them): the ranks use the others, so no card holds a rank and the server.
One process: the data stages, and pretrain with real weights (it only exports them).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

DEFAULTS = {"device": "auto", "nproc": "auto", "train_nproc": "auto", "llm_gpus": 0}
DEVICES = ("auto", "cpu", "cuda")


class ComputeError(ValueError):
    """A compute setting or batch that cannot run: `param` is the key to change, `fixes` values that would work."""

    def __init__(self, message: str, param: str, fixes: list | None = None):
        super().__init__(message)
        self.param, self.fixes = param, list(fixes or [])


def _count(values: dict, key: str, auto: bool, minimum: int) -> int | str:
    value = values[key]
    if auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ComputeError(f"compute.{key} must be {'auto or ' if auto else ''}an integer >= {minimum}, got {value!r}",
                           f"compute.{key}", [f"compute.{key}: {'auto' if auto else minimum}"])
    return value


def settings(values: dict | None) -> dict:
    """params `compute` with the defaults filled and every value checked (an unknown key is an error)."""
    values = {**DEFAULTS, **(values or {})}
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ComputeError(f"compute: unknown keys {unknown} (known: {sorted(DEFAULTS)})", f"compute.{unknown[0]}")
    if values["device"] not in DEVICES:
        raise ComputeError(f"compute.device must be one of {', '.join(DEVICES)}, got {values['device']!r}",
                           "compute.device", [f"compute.device: {d}" for d in DEVICES])
    return {"device": values["device"], "nproc": _count(values, "nproc", True, 1),
            "train_nproc": _count(values, "train_nproc", True, 1), "llm_gpus": _count(values, "llm_gpus", False, 0)}


def uses_cuda(compute: dict, visible_gpus: int) -> bool:
    """Do the model stages run on GPUs? (device cuda with none visible fails in `distributed.resolve_device`.)"""
    return compute["device"] != "cpu" and visible_gpus > 0


def rank_gpus(compute: dict, visible: list[str]) -> list[str]:
    """The visible GPUs (ids as CUDA_VISIBLE_DEVICES names them) the ranks may use: all but the last `llm_gpus`."""
    keep = len(visible) - compute["llm_gpus"]
    if visible and keep < 1:
        raise ComputeError(f"compute.llm_gpus {compute['llm_gpus']} keeps every one of the {len(visible)} visible GPUs "
                           "for the LLM server: no GPU is left for the ranks", "compute.llm_gpus",
                           [f"compute.llm_gpus: {n}" for n in range(len(visible))])
    return list(visible[:max(keep, 0)])


def item_ranks(compute: dict, gpus: int, cuda: bool) -> int:
    """Ranks per node of an item stage (and the most a training stage takes): `nproc`, auto = every GPU."""
    nproc = compute["nproc"]
    if nproc == "auto":
        return max(gpus, 1) if cuda else 1
    if cuda and nproc > gpus:
        raise ComputeError(f"compute.nproc {nproc} is more than the {gpus} GPU(s) the ranks may use",
                           "compute.nproc", [f"compute.nproc: {n}" for n in ("auto", *range(gpus, 0, -1))])
    return nproc


def splits(global_batch: int, ranks: int, accum_steps: int = 1) -> bool:
    """Does the global batch split into `ranks` equal shares of `accum_steps` equal micro-batches?"""
    return global_batch % (ranks * accum_steps) == 0


def training_ranks(compute: dict, global_batch: int, most: int, nodes: int = 1, accum_steps: int = 1,
                   param: str = "train.batch_size") -> int:
    """Ranks per node of a training stage whose global batch is `global_batch`, at most `most` per node (the item
    stages' count) on `nodes` nodes. auto = the largest count whose nodes x count splits the batch; a count that
    does not split it (or auto with none) raises a ComputeError naming `param` and the values that work."""
    setting = compute["train_nproc"]
    if setting != "auto" and setting > most:
        raise ComputeError(f"compute.train_nproc {setting} is more than the {most} rank(s) per node the stages may "
                           f"use (compute.nproc)", "compute.train_nproc",
                           ["compute.train_nproc: auto"] + [f"compute.train_nproc: {k}" for k in
                                                            working_counts(global_batch, most, nodes, accum_steps)])
    candidates = range(most, 0, -1) if setting == "auto" else [setting]
    for k in candidates:
        if splits(global_batch, k * nodes, accum_steps):
            return k
    what = f"{nodes} node(s) x {setting if setting != 'auto' else 'any count <= ' + str(most)} rank(s)"
    micro = f" in {accum_steps} micro-batches each (train.accum_steps)" if accum_steps > 1 else ""
    counts = working_counts(global_batch, most, nodes, accum_steps)
    raise ComputeError(f"{param} {global_batch} (the global batch) does not split evenly over {what}{micro}",
                       param, [f"{param}: {b}" for b in batch_fixes(global_batch, most * nodes, accum_steps)]
                       + [f"compute.train_nproc: {k}" for k in counts]
                       + (["compute.train_nproc: auto"] if setting != "auto" and counts else []))


def working_counts(global_batch: int, most: int, nodes: int = 1, accum_steps: int = 1) -> list[int]:
    """Rank counts per node (<= most) that split the global batch, largest first."""
    return [k for k in range(most, 0, -1) if splits(global_batch, k * nodes, accum_steps)]


def batch_fixes(global_batch: int, ranks: int, accum_steps: int = 1) -> list[int]:
    """The global batches nearest `global_batch` (one below, one above) that split over all `ranks`."""
    step = ranks * accum_steps
    below, above = global_batch // step * step, -(-global_batch // step) * step
    return sorted({b for b in (below, above) if b > 0})


# ------------------------------------------------------------------------------------------------ GPU locks
LOCK_DIR = Path(tempfile.gettempdir()) / f"clipfinetune-gpus-{os.getuid()}"   # per user: another's files are not ours


@contextlib.contextmanager
def gpu_locks(gpu_ids: list[str], on_wait=None, lock_dir: Path | None = None):
    """Hold an exclusive lock per GPU (a file per id under the host's temp folder, flock'ed) while the block runs, so
    that stages of concurrent experiments on one host (`dvc queue start -j N`) never share a card: a stage waits for
    the cards another holds (`on_wait(ids)` is called once before waiting). Locks are taken in sorted order (no
    deadlock between two stages wanting overlapping sets) and released by the OS if the process dies."""
    if not gpu_ids:                   # the CPU: nothing to share
        yield
        return
    lock_dir = Path(lock_dir or LOCK_DIR)
    lock_dir.mkdir(parents=True, exist_ok=True)
    held = []
    try:
        for gpu in sorted(gpu_ids):
            fd = os.open(lock_dir / f"gpu-{gpu}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            held.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if on_wait is not None:
                    on_wait(gpu)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in held:
            os.close(fd)                      # closing the descriptor releases its lock
