"""Training checkpoints: a plain dict, written atomically, read with `weights_only=True`, and fingerprinted.

A checkpoint holds everything a resumed run needs to continue bit for bit (CPU, same world size): model (the
built method module, teachers included), optimiser, scheduler, step, epoch, position in the epoch (micro-batches),
every rank's RNG states (python, numpy, torch, cuda) and the method's extra state.

The FINGERPRINT (`fingerprint()`) ties a checkpoint to one run: sha256 over the stage name, the declared params,
the world size and a content digest of each of the stage's dvc.yaml deps (a file's BLAKE2b, a folder's over its
files; stages/_common.py `stage_inputs`, through the project's digest cache: a big input is hashed once, and a
`dvc checkout` that rewrites an unchanged file changes nothing). The deps are the run's data and the digests of the
code it imports (data/code, clipfinetune/project/deps.py): a changed loss retrains, never "resumes" a finished run.
Every rank computes it and `check_ranks_agree` stops the run when they differ (nodes with other code or data). On a
mismatch with the checkpoint the trainer starts from scratch.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import torch

from clipfinetune.io import atomic_path

FORMAT = "clipfinetune-train-checkpoint/1"
LAST = "last.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file and says what to do."""


def fingerprint(stage: str, params: dict, inputs: dict[str, str], world_size: int = 1) -> str:
    """sha256 of the stage, its declared params, the world size and `inputs` (dep path -> its content hash)."""
    return hashlib.sha256(json.dumps({"stage": stage, "params": params, "world_size": world_size,
                                      "inputs": dict(inputs)}, sort_keys=True, default=str).encode()).hexdigest()


def check_ranks_agree(fp: str, dist) -> None:
    """Every rank's fingerprint must be the same (all_gather); a rank whose code, data or params differ would
    resume, or start, another run than its peers."""
    if not dist.distributed:
        return
    import torch.distributed as td

    every: list = [None] * dist.world_size
    td.all_gather_object(every, fp)
    differ = {rank: f for rank, f in enumerate(every) if f != every[0]}
    if differ:
        raise CheckpointError(f"ranks disagree on the run's fingerprint (params, deps' content, world size): rank 0 "
                              f"{every[0][:12]}, " + ", ".join(f"rank {r} {f[:12]}" for r, f in differ.items())
                              + ": give every node the same code, data and params")


# ---------------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """Every RNG the loop touches, as tensors/lists (loadable with weights_only=True)."""
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"],
                         "state": {"key": np.asarray(n["key"], dtype=np.uint32), "pos": n["pos"]},
                         "has_gauss": n["has_gauss"], "gauss": n["gauss"]})
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------- file I/O
def save_checkpoint(path: str | os.PathLike, checkpoint: dict) -> None:
    """Write atomically: a kill mid-write leaves the previous checkpoint untouched."""
    with atomic_path(path) as tmp:
        torch.save({"format": FORMAT, **checkpoint}, tmp)


def remove_checkpoints(checkpoint_dir: str | os.PathLike) -> None:
    """Delete a run's resume checkpoints once its model is exported: DVC caches the exported model, and a
    checkpoint (weights + optimiser state, ~3x the model) is then never read again."""
    import shutil

    shutil.rmtree(checkpoint_dir, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Read a checkpoint with `weights_only=True`; a clear `CheckpointError` naming the file otherwise."""
    path = Path(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused: it contains pickled Python objects beyond tensors and plain containers "
            f"(loaded with weights_only=True). Do not trust it; delete it to train from scratch. ({e})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read this checkpoint (truncated or corrupt?): {e}. "
                              f"Delete it to train from scratch.") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a clipfinetune training checkpoint (format "
                              f"{ckpt.get('format') if isinstance(ckpt, dict) else type(ckpt).__name__!r}, "
                              f"expected {FORMAT!r}). Delete it to train from scratch.")
    return ckpt
