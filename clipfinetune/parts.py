"""Per-rank part files of the item stages (segments, lism, eval): split, resume, merge.

The items of a stage (images, in a fixed order) are cut into WORK UNITS of a fixed number of items by position
(`work_units`); unit k goes to rank k mod world_size (`units_of_rank`). Whatever the number of ranks, a unit holds
the same items and each item is computed by the same code, so the merged result cannot depend on it. Each unit's
result is one part file, written atomically under `<cache_root>/<stage>/<fingerprint>/`, outside DVC's outputs
(DVC deletes a stage's outs before running it): a killed run re-run with the same fingerprint skips the units
whose parts exist (resume); rank 0 reads every part in unit order and writes the stage's outputs. A unit may also
write files (`PartStore.files_dir`, before its part): rank 0 links them into the outputs.

The FINGERPRINT (`fingerprint`) covers what determines the parts: the stage, the params it computes with, the unit
size, the device type (a GPU computes other float bits) and its dvc.yaml deps: code and config files (.py, .json,
.yaml, .txt) by content, every other file (images, tables, weights) by size + mtime, so a real corpus is never
re-read; a false mismatch (a rewritten unchanged file) only costs a recomputation, never a stale part. Parts of any
other fingerprint are stale: they are never read, and rank 0 deletes them when it starts; the parts of a finished run
are deleted after its outputs are written. Several nodes need `cache_root` on a shared file system (rank 0 reads every
rank's parts).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from clipfinetune.io import atomic_path

PART_FORMAT = "clipfinetune-part/1"


_BY_CONTENT = {".py", ".json", ".yaml", ".yml", ".txt", ".toml"}


def fingerprint(stage: str, settings: dict, inputs: Sequence[str | os.PathLike], root: str | os.PathLike = ".") -> str:
    """sha256 (hex, first 24 digits) of the stage, its `settings` (params, unit size, device type) and its inputs."""
    h = hashlib.sha256(json.dumps({"stage": stage, "settings": settings}, sort_keys=True, default=str).encode())
    for rel in sorted(str(p) for p in inputs):
        path = Path(root) / rel
        h.update(f"\0input {rel}\0".encode())
        files = [path] if path.is_file() else sorted(
            p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) if path.is_dir() else []
        for f in files:
            name = f.relative_to(path).as_posix() if f != path else f.name
            if f.suffix.lower() in _BY_CONTENT:
                h.update(f"{name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
            else:
                st = f.stat()
                h.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def work_units(items: Sequence, unit_size: int) -> list[Sequence]:
    """`items` cut by position into consecutive units of `unit_size` (the last one shorter)."""
    if unit_size < 1:
        raise ValueError(f"unit_size must be >= 1, got {unit_size}")
    return [items[i:i + unit_size] for i in range(0, len(items), unit_size)]


def units_of_rank(n_units: int, rank: int, world_size: int) -> list[int]:
    """The unit indices rank `rank` of `world_size` computes: round-robin, so ranks stay balanced."""
    return list(range(rank, n_units, world_size))


class PartStore:
    """The part files of one stage run: `<root>/<stage>/<key>/unit-<k>.json` (codec "json": floats round-trip
    exactly) or `.pt` (codec "torch": tensors, read back with `weights_only=True`)."""

    def __init__(self, root: str | Path, stage: str, key: str, codec: str = "json"):
        if codec not in ("json", "torch"):
            raise ValueError(f"codec must be json or torch, got {codec!r}")
        self.stage_dir = Path(root) / stage.replace("@", "-")
        self.dir = self.stage_dir / key
        self.key, self.codec = key, codec

    def remove_stale(self) -> list[str]:
        """Delete the parts of every other fingerprint (rank 0, before any rank writes); returns their keys."""
        stale = [p for p in self.stage_dir.iterdir() if p.is_dir() and p.name != self.key] \
            if self.stage_dir.is_dir() else []
        for p in stale:
            shutil.rmtree(p, ignore_errors=True)
        return sorted(p.name for p in stale)

    def path(self, unit: int) -> Path:
        return self.dir / f"unit-{unit:06d}.{'json' if self.codec == 'json' else 'pt'}"

    @property
    def files_dir(self) -> Path:
        """Where units write files beside their parts (e.g. LISM's test images). A unit writes its files before its
        part, so the files of every part that exists are whole; they go with the parts (`remove_stale`, `clear`)."""
        return self.dir / "files"

    def has(self, unit: int) -> bool:
        return self.path(unit).is_file()

    def write(self, unit: int, item_ids: list[str], result) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        part = {"format": PART_FORMAT, "key": self.key, "unit": unit, "item_ids": list(item_ids), "result": result}
        with atomic_path(self.path(unit)) as tmp:
            if self.codec == "json":
                tmp.write_text(json.dumps(part))
            else:
                import torch

                torch.save(part, tmp)

    def read(self, unit: int, item_ids: list[str]):
        """The unit's result; an error naming the file if it is not the part of these items under this key."""
        path = self.path(unit)
        try:
            if self.codec == "json":
                part = json.loads(path.read_text())
            else:
                import torch

                part = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
            raise RuntimeError(f"{path}: unreadable part file ({e}); delete {self.dir} and re-run") from e
        if (part.get("format"), part.get("key"), part.get("unit"), part.get("item_ids")) != \
                (PART_FORMAT, self.key, unit, list(item_ids)):
            raise RuntimeError(f"{path}: not the part of unit {unit} of this run; delete {self.dir} and re-run")
        return part["result"]

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Progress:
    """A log line every `every_s` seconds (and at the end): units done, items/s and ETA."""

    def __init__(self, log: logging.Logger, what: str, total_units: int, total_items: int, every_s: float = 30.0):
        self.log, self.what, self.every_s = log, what, every_s
        self.total_units, self.total_items = total_units, total_items
        self.units = self.items = 0
        self.t0 = self.last = time.monotonic()

    def update(self, n_items: int) -> None:
        self.units += 1
        self.items += n_items
        now = time.monotonic()
        if now - self.last >= self.every_s or self.units == self.total_units:
            self.last = now
            rate = self.items / max(now - self.t0, 1e-9)
            eta = (self.total_items - self.items) / rate if rate > 0 else float("inf")
            self.log.info("%s: %d/%d units, %d/%d items, %.2f items/s, ETA %.0f s", self.what, self.units,
                          self.total_units, self.items, self.total_items, rate, eta)


def compute_parts(store: PartStore, units: list[Sequence], ids_of, compute, rank: int, world_size: int,
                  log: logging.Logger, what: str, stream: bool = False) -> dict:
    """Compute this rank's units that have no part yet (`compute(unit_items)` -> the part's result; with `stream`,
    `compute(list of units)` -> an iterator of their results in order, e.g. through a DataLoader), writing each
    part as it finishes. `ids_of(item)`: the item's id (kept in the part and checked when it is read). Logs
    progress (rate, ETA). Returns {"units": this rank's units, "resumed": how many had a part already}."""
    mine = units_of_rank(len(units), rank, world_size)
    todo = [k for k in mine if not store.has(k)]
    resumed = len(mine) - len(todo)
    if resumed:
        log.info("%s: resuming, %d of this rank's %d units already done (%s)", what, resumed, len(mine), store.dir)
    progress = Progress(log, f"{what} (rank {rank}/{world_size})", len(todo), sum(len(units[k]) for k in todo))
    results = compute([units[k] for k in todo]) if stream else (compute(units[k]) for k in todo)
    for k, result in zip(todo, results, strict=True):
        store.write(k, [ids_of(it) for it in units[k]], result)
        progress.update(len(units[k]))
    return {"units": len(mine), "resumed": resumed}


def read_parts(store: PartStore, units: list[Sequence], ids_of) -> list:
    """Every unit's result, in unit order (rank 0, after every rank finished)."""
    return [store.read(k, [ids_of(it) for it in unit]) for k, unit in enumerate(units)]


def run_sharded(store: PartStore, units: list[Sequence], ids_of, compute, rank: int, world_size: int, barrier,
                log: logging.Logger, what: str, stream: bool = False) -> list | None:
    """The whole split: rank 0 deletes stale parts, every rank computes its missing units, and after a barrier
    rank 0 returns every unit's result in unit order (other ranks: None). `barrier()`: the process group's (a
    no-op with one process)."""
    if rank == 0:
        stale = store.remove_stale()
        if stale:
            log.info("%s: deleted the parts of other runs (%s)", what, ", ".join(stale))
    barrier()
    done = compute_parts(store, units, ids_of, compute, rank, world_size, log, what, stream)
    log.info("%s: rank %d computed %d units (%d resumed from parts)", what, rank, done["units"] - done["resumed"],
             done["resumed"])
    barrier()
    return read_parts(store, units, ids_of) if rank == 0 else None
