"""The training loader: shards -> method batches, every unit of an epoch exactly once across all readers.

An epoch is cut in named steps, read top to bottom (`UnitTable` -> `Schedule` -> `_EpochStream` -> `ShardLoader`):

1. **Units** (`UnitTable`, once per loader): the shard index (`index.json`, written by the `shards` stage) names the
   sources whose records the method wants (its field signatures) and every record's shard and byte offsets; each
   record's json is read by offset (images are never read here) and `method.wants` applied. A wanted record is one
   unit (`epoch_unit` "image": `make_example` draws a caption/row with its rng) or `method.units(record)` units
   ("method": captions, word-region pairs; `unit_record` narrows the record to one). `epoch_samples` = N > 0 (fewer
   than the units) keeps a FIXED subset, drawn once per run: `random.Random(f"{seed}:epoch_samples").sample` of the
   sorted unit names ("<key>" or "<key>#<unit>"), every epoch one pass over it (FSC-CLIP App. A.3's 100K).
2. **Order** (`Schedule.order`): epoch e is one pass over the N units in an order seeded by (seed, e) (numpy's
   SeedSequence([seed, e])), with the sibling rule applied (below).
3. **Stream and remainder rule**: the passes follow one another as ONE stream, cut into global batches of G =
   micro-batch x ranks x accum_steps units; optimiser step k reads stream positions [kG, (k+1)G). The steps of epoch
   e are those whose batch starts in pass e: ceil((e+1)N/G) - ceil(eN/G), i.e. floor(N/G) or ceil(N/G), and a run of
   E epochs is ceil(EN/G) steps. So every unit comes exactly once per pass and nothing is dropped: when G does not
   divide N, one batch per epoch holds the end of a pass and the start of the next, and the run's last batch is
   completed from pass E's order (fewer than G units, the only reads beyond the run's epochs).
4. **Partition** (`Schedule.micro_batches`, `Schedule.positions`): a step is `accum_steps` micro-steps of ranks x
   micro-batch units; rank r takes the r-th micro-batch-sized slice of each; DataLoader worker w of W takes every W-th
   of the rank's micro-batches from where the iteration starts, which is the order in which torch's DataLoader
   returns its workers' batches (round-robin). A record is read by offset wherever it is needed, so the contents of
   a global step do not depend on the number of ranks or workers (training is rank-count invariant up to the order
   of float reductions), and every unit is read by exactly one reader. `epoch_coverage` runs these same functions
   for `clipfinetune plan`.
5. **Sibling rule** (`_separate_siblings`): no global batch holds two units of one record (sibling captions would be
   false negatives) wherever a swap with a unit of another whole batch of the same pass avoids it; this includes the
   batch shared by two passes (the head of a pass is checked against the tail of the previous one). The tail of a
   pass (its last, partial batch) is settled first and never changed again, so the next pass computes it from
   (seed, e - 1) alone. With fewer units than a global batch no swap is possible and siblings may meet.
6. **Examples** (`_EpochStream`): the unit at stream position p is decoded and `make_example(record, image, rng,
   ctx)` gets rng = `random.Random(f"{seed}:{p}")`; its first draw (`getrandbits(63)`) seeds the CPU torch generator
   first, so random augmentations are a function of the position too, at any worker count (with num_workers=0 the
   main process's torch RNG is saved and restored around the example). A corrupt image (the `shards` stage verified
   every image, so only on-disk damage after it) is a counted skip (`corrupt_images_skipped`); in training the next unit
   of the pass order that decodes takes its place (counted as `units_repeated`), so every rank's batch keeps its size.

Decisions:
- **Resume** at (epoch, micro-batch k): the workers start at micro-batch k of the epoch directly (no sample is read
  or decoded twice); the same global batch gives the same batches. A different rank count reads the same global
  batches too, but the trainer's checkpoint keeps per-rank RNG states and its world size: `Trainer` treats a
  changed rank count as another run and trains from scratch.
- **Determinism**: every choice is a function of (seed, epoch, stream position), never of the rank or worker.
- **Persistent workers**: one DataLoader per loader, `persistent_workers=True`; the epoch and the start reach the
  workers through shared `multiprocessing.Value`s (open_clip's SharedEpoch), so lazy per-worker resources (FSC-CLIP's
  spaCy + WordNet, ~10 s) load once per run. Nothing is warmed in the main process before the fork (NLTK's WordNet
  reader keeps file handles whose offsets forked workers would share); records are read with `os.pread`, which has
  no shared offset.
- **Pixels travel as uint8**: `ExampleContext.of_model` resizes with `model.pixel_transform` (torchvision's uint8
  bicubic; PIL's bicubic and the float conversion were most of a worker's time) and the model normalises the batch
  on its device; with `pin_memory` the batches reach the trainer in page-locked memory (benchmarks/README.md has the
  per-worker rates).
- **Statistics** (examples, corrupt images, repeats) are counted in the workers, travel with each batch and are
  summed in `ShardLoader.stats`; each epoch ends with a log line. Records the method does not want are counted once
  (`ShardLoader.dropped_by_method`).
- **Validation** (`train=False`): one pass over the wanted records in index order, no shuffle, no repeats; rank r
  takes every world-th record, in batches that may end partial; workers take every W-th batch.
- **The record index, not `wids`**: webdataset's `wids` gives indexed access too, but it copies every shard into a
  cache folder (`/tmp/_wids_cache` unless told otherwise), re-scans each tar's headers in every worker that opens
  it, and its index lists per-shard sample counts only. Here the `shards` stage writes each record's member offsets
  once (`clipfinetune.data.prepare.shards.index_shards`), so the loader and `epoch_coverage` read them without
  opening a tar header, and a reader is `os.pread` on the shard file.
"""
from __future__ import annotations

import json
import logging
import math
import os
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from clipfinetune import boxes as boxlib
from clipfinetune.io import InputError, read_image

log = logging.getLogger(__name__)
INDEX = "index.json"            # the shards stage's index (clipfinetune.data.prepare.shards.index_shards)
READ_MEMBERS = ("jpg", "json")  # what the loader reads of a record
OPEN_SHARDS = 64                # file handles a reader keeps open (least recently used closed first)


class ExampleContext:
    """What `Method.make_example` may use, built once from the model (DEVELOPERS.md)."""

    def __init__(self, transform: Callable, tokenize: Callable, image_size: int | tuple[int, int],
                 tokenize_long: Callable | None = None, token_span: Callable | None = None,
                 random_geometry: bool = False):
        self.transform, self.tokenize, self.image_size = transform, tokenize, image_size
        self._tokenize_long, self._token_span = tokenize_long, token_span
        self.random_geometry = random_geometry      # `transform` crops at random: no box can follow its pixels

    @classmethod
    def of_model(cls, model, transform: Callable | None = None, random_geometry: bool = False) -> ExampleContext:
        """The context of a `ClipModel`, the one way to build it: its uint8 pixel transform (`model.pixel_transform`:
        the squash resize of `model.transform`, or with `random_geometry` open_clip's random resized crop of
        `model.train_transform()`; the model normalises the uint8 batch on its device) unless `transform` is given,
        tokenizer, input size and token spans, and the long-text tokenizer at Long-CLIP's context
        (`models.LONG_CONTEXT`, GOAL's and MulCLIP's)."""
        from clipfinetune.models import LONG_CONTEXT

        transform = transform or model.pixel_transform(train=random_geometry)
        return cls(transform, model.tokenize, model.image_size, token_span=model.token_span,
                   tokenize_long=lambda texts: model.tokenize(texts, context_length=LONG_CONTEXT),
                   random_geometry=random_geometry)

    def tokenize_long(self, texts):
        if self._tokenize_long is None:
            raise RuntimeError("this ExampleContext has no long-text tokenizer (pass tokenize_long=)")
        return self._tokenize_long(texts)

    def resize_boxes(self, boxes, orig_wh: tuple[int, int]) -> torch.Tensor:
        """xyxy boxes in original pixels -> pixels of the squash-resized model input (boxes.py)."""
        if self.random_geometry:
            raise ValueError("this method reads boxes, which cannot follow a random crop of the image: train it with "
                             "train_transform: squash (random_resized_crop is for image-text methods only)")
        t = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
        return boxlib.resize_boxes(t, orig_wh, self.image_size)

    def crop(self, image, box, scale: float = 1.0) -> torch.Tensor:
        """The transformed crop of `box` (original pixels), enlarged about its centre by `scale`."""
        wh = image.size
        b = boxlib.enlarge_box(box, scale, wh) if scale != 1.0 else boxlib.clip_box(box, wh)
        if b is None:
            raise ValueError(f"box {list(box)} has no area inside the {wh} image")
        return self.transform(image.crop(tuple(round(v) for v in b)))

    def token_span(self, text: str, char_start: int, char_end: int) -> list[int]:
        if self._token_span is None:
            raise RuntimeError("this ExampleContext has no token_span (pass token_span=model.token_span)")
        return self._token_span(text, char_start, char_end)


# ------------------------------------------------------------------------------------------ the shard index
def load_index(shards_dir: str | os.PathLike) -> dict:
    """The shards' `index.json`; missing or unreadable: an InputError naming the file and the stage that writes it."""
    path = Path(shards_dir) / INDEX
    if not path.is_file():
        raise InputError(path, None, "missing: the shard index is written by stage `shards` (run `dvc repro shards`)")
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, None, f"unreadable shard index ({e}): re-run `dvc repro shards`") from e
    if not isinstance(index, dict):
        raise InputError(path, None, "not a shard index (expected {split: {source: ...}}): re-run `dvc repro shards`")
    return index


def wanted_sources(shards_dir: str | Path, split: str, method) -> list[str]:
    """The sources of `split` whose records `method` wants, from the shard index: a source is read iff `method.wants`
    accepts the example record of one of its field signatures (`wants` looks at which fields a record carries,
    never at its source)."""
    index = load_index(shards_dir).get(split) or {}
    return sorted(source for source, entry in index.items()
                  if any(method.wants(sig["example"]) for sig in entry.get("signatures", [])))


class RecordStore:
    """The records of some sources of one split, each read by offset from its shard (`os.pread`; a few shard files
    kept open per process, reopened after a fork or pickling)."""

    def __init__(self, shards_dir: str | Path, split: str, sources: list[str]):
        index_path = Path(shards_dir) / INDEX
        entries = load_index(shards_dir).get(split) or {}
        self.paths: list[str] = []
        keys, shard, offset, size = [], [], {m: [] for m in READ_MEMBERS}, {m: [] for m in READ_MEMBERS}
        for source in sources:
            entry = entries.get(source)
            table = entry.get("records") if isinstance(entry, dict) else None
            try:
                n = len(table["keys"])
                if not (len(table["shard"]) == n and all(len(table["offset"][m]) == len(table["size"][m]) == n
                                                         for m in READ_MEMBERS)):
                    raise ValueError("columns of different lengths")
                shard += [len(self.paths) + s for s in table["shard"]]
            except (KeyError, TypeError, ValueError) as e:
                raise InputError(index_path, f"{split}/{source}", f"no valid record table ({e!r}); an index written "
                                 f"before record tables existed? re-run `dvc repro shards`") from None
            self.paths += [str(Path(shards_dir) / name) for name in entry["shards"]]
            keys += table["keys"]
            for m in READ_MEMBERS:
                offset[m] += table["offset"][m]
                size[m] += table["size"][m]
        self.keys = keys
        self.shard = np.asarray(shard, dtype=np.int64)
        self.offset = {m: np.asarray(v, dtype=np.int64) for m, v in offset.items()}
        self.size = {m: np.asarray(v, dtype=np.int64) for m, v in size.items()}
        self._check_shards(index_path)
        self._files: OrderedDict[int, int] = OrderedDict()
        self._pid = os.getpid()

    def _check_shards(self, index_path: Path) -> None:
        """Every listed shard exists and is as long as its records say (an index that disagrees with the tars)."""
        ends = np.zeros(len(self.paths), dtype=np.int64)
        for m in READ_MEMBERS:
            np.maximum.at(ends, self.shard, self.offset[m] + self.size[m])
        for path, end in zip(self.paths, ends.tolist()):
            if not os.path.isfile(path):
                raise InputError(path, None, f"listed in {index_path} but missing: re-run `dvc repro shards`")
            if os.path.getsize(path) < end:
                raise InputError(path, None, f"shorter than {index_path} says ({os.path.getsize(path)} < {end} "
                                             f"bytes): the index and the shards disagree; re-run `dvc repro shards`")

    def __len__(self) -> int:
        return len(self.keys)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": OrderedDict()}          # open files stay with their process

    def read(self, i: int, member: str) -> bytes:
        s = int(self.shard[i])
        if self._pid != os.getpid():             # a forked worker: its own descriptors (closing the parent's is fine)
            self._files, self._pid = OrderedDict(), os.getpid()
        fd = self._files.pop(s, None)
        if fd is None:
            fd = os.open(self.paths[s], os.O_RDONLY)
            while len(self._files) >= OPEN_SHARDS:
                os.close(self._files.popitem(last=False)[1])
        self._files[s] = fd
        size = int(self.size[member][i])
        data = os.pread(fd, size, int(self.offset[member][i]))
        if len(data) != size:
            raise InputError(self.paths[s], self.keys[i], f"truncated .{member} member ({len(data)} of {size} bytes)")
        return data

    def record(self, i: int) -> dict:
        try:
            return json.loads(self.read(i, "json"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(self.paths[int(self.shard[i])], self.keys[i], f"unreadable json member ({e})") from e

    def close(self) -> None:
        if self._pid == os.getpid():
            for fd in self._files.values():
                os.close(fd)
        self._files = OrderedDict()


# ------------------------------------------------------------------------------------------ 1. units
class UnitTable:
    """The units of an epoch: (record, unit) pairs of the records `method` wants (module docstring, step 1)."""

    def __init__(self, shards_dir: str | Path, split: str, method, *, per_unit: bool, epoch_samples: int = 0,
                 seed: int = 0):
        sources = wanted_sources(shards_dir, split, method)
        if not sources:
            if not (load_index(shards_dir).get(split) or {}):
                raise InputError(shards_dir, split, f"no {split} shards in the index (run `dvc repro shards`)")
            raise InputError(shards_dir, split, f"method {method.name!r} wants the records of no source (do "
                             f"`shards.sources` and the data stages whose tables it reads, `<stage>.sources`, "
                             f"include its corpus?)")
        self.store = RecordStore(shards_dir, split, sources)
        self.method, self.per_unit = method, per_unit
        wanted, counts = [], []
        for i in range(len(self.store)):
            record = self.store.record(i)
            if method.wants(record):
                wanted.append(i)
                counts.append(method.units(record) if per_unit else 1)
        self.num_samples, self.num_wanted = len(self.store), len(wanted)
        if not wanted:
            raise InputError(shards_dir, split, f"method {method.name!r} wants none of the {self.num_samples} samples")
        counts_arr = np.asarray(counts, dtype=np.int64)
        self.records = np.repeat(np.asarray(wanted, dtype=np.int64), counts_arr)       # store position per unit
        starts = np.cumsum(counts_arr) - counts_arr
        self.numbers = np.arange(len(self.records)) - np.repeat(starts, counts_arr)   # unit index in its record
        self.all_units, self.most_units = len(self.records), int(counts_arr.max())
        if epoch_samples < 0:
            raise ValueError(f"epoch_samples must be >= 0, got {epoch_samples}")
        if 0 < epoch_samples < len(self.records):
            names = self.names()
            drawn = set(random.Random(f"{seed}:epoch_samples").sample(sorted(names), epoch_samples))
            keep = np.fromiter((n in drawn for n in names), dtype=bool, count=len(names))
            self.records, self.numbers = self.records[keep], self.numbers[keep]
        self.store.close()

    def __len__(self) -> int:
        return len(self.records)

    def names(self) -> list[str]:
        """"<key>#<unit>" (per unit) or "<key>" of each unit, in table order."""
        keys = self.store.keys
        if self.per_unit:
            return [f"{keys[r]}#{u}" for r, u in zip(self.records.tolist(), self.numbers.tolist())]
        return [keys[r] for r in self.records.tolist()]

    def read(self, unit: int) -> tuple[str, dict, bytes, str]:
        """(key, record narrowed to the unit, jpg bytes, where it lies) of unit `unit`."""
        i = int(self.records[unit])
        record = self.store.record(i)
        if self.per_unit:
            record = self.method.unit_record(record, int(self.numbers[unit]))
        return self.store.keys[i], record, self.store.read(i, "jpg"), self.store.paths[int(self.store.shard[i])]


# ------------------------------------------------------------------------------------------ 2-5. the schedule
@dataclass(eq=False)
class Schedule:
    """Training: which units every rank and worker reads, at any ranks x workers (module docstring, steps 2-5)."""

    units: int                              # N, units of one epoch
    micro_batch: int                        # B, per rank
    world_size: int = 1
    accum_steps: int = 1
    seed: int = 0
    unit_records: np.ndarray | None = None  # the record of each unit, for the sibling rule (None: no rule)
    _orders: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if min(self.units, self.micro_batch, self.world_size, self.accum_steps) < 1:
            raise ValueError(f"a schedule needs units, micro-batch, ranks and accum_steps >= 1: {self}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.world_size * self.accum_steps

    def first_step(self, epoch: int) -> int:
        """The optimiser step at which `epoch` starts: the first global batch that starts in its pass."""
        return -(-epoch * self.units // self.global_batch)

    def steps(self, epochs: int) -> int:
        """Optimiser steps of a run of `epochs` epochs."""
        return self.first_step(epochs)

    def epoch_length(self, epoch: int, rank: int = 0) -> int:
        """Micro-batches of `epoch` on every rank."""
        return (self.first_step(epoch + 1) - self.first_step(epoch)) * self.accum_steps

    def micro_batches(self, epoch: int, start: int, worker: int = 0, workers: int = 1, rank: int = 0) -> range:
        """The stream's micro-step indices that worker `worker` of `workers` of a rank yields for `epoch` from the
        epoch's micro-batch `start` on, in order (the same for every rank)."""
        first = self.first_step(epoch) * self.accum_steps
        return range(first + start + worker, self.first_step(epoch + 1) * self.accum_steps, workers)

    def positions(self, micro, rank: int) -> np.ndarray:
        """Stream positions of rank `rank`'s micro-batch in micro-step(s) `micro`: [..., micro_batch]."""
        at = np.asarray(micro, dtype=np.int64)[..., None] * (self.micro_batch * self.world_size)
        return at + rank * self.micro_batch + np.arange(self.micro_batch)

    def batch_positions(self, micro: int, rank: int) -> np.ndarray:
        return self.positions(micro, rank)

    def units_at(self, positions: np.ndarray) -> np.ndarray:
        """The unit at each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(positions)
        passes = positions // self.units
        for e in np.unique(passes).tolist():
            here = passes == e
            out[here] = self.order(e)[positions[here] - e * self.units]
        return out

    def candidates(self, position: int) -> Iterator[int]:
        """The unit at `position`, then the units after it in its pass's order (a corrupt image's replacements)."""
        e, i = divmod(int(position), self.units)
        order = self.order(e)
        for j in range(self.units):
            yield int(order[(i + j) % self.units])

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s pass: the N unit ids in its seeded order, the sibling rule applied (cached)."""
        if epoch not in self._orders:
            if len(self._orders) >= 3:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = self._pass_order(epoch, after_previous=True)
        return self._orders[epoch]

    def _pass_order(self, epoch: int, after_previous: bool) -> np.ndarray:
        n, g = self.units, self.global_batch
        order = np.random.default_rng([self.seed % 2 ** 63, epoch]).permutation(n)
        if self.unit_records is None:
            return order
        head = self.first_step(epoch) * g - epoch * n      # this pass's units in the batch the previous pass began
        before = np.empty(0, dtype=np.int64)
        if after_previous and epoch > 0 and head > 0:
            previous = self._pass_order(epoch - 1, after_previous=False)     # its tail does not depend on its head
            start = max(0, (self.first_step(epoch) - 1) * g - (epoch - 1) * n)
            before = self.unit_records[previous[start:]]
        _separate_siblings(order, self.unit_records, head, g, before)
        return order


def _separate_siblings(order: np.ndarray, unit_records: np.ndarray, head: int, batch: int,
                       before: np.ndarray) -> None:
    """The sibling rule on one pass, in place: segments are the head (positions < `head`, sharing a global batch with
    the previous pass's units of records `before`), the whole batches, and the tail (the last, partial batch). Tail
    first, then head, then the whole batches with a repeated record: a unit whose record is already in its segment
    swaps with a unit of a whole batch that does not hold its record and whose record the segment does not hold, so
    a swap never makes a new pair and never touches the tail or the head."""
    n = len(order)
    head = min(head, n)
    whole = (n - head) // batch
    tail = head + whole * batch
    if whole == 0:
        return                                  # nothing to swap with (fewer units than a global batch)
    recs = unit_records[order]
    width = int(recs.max()) + 1
    keys = np.sort((np.arange(tail - head) // batch) * width + recs[head:tail])
    repeated = np.unique(keys[1:][keys[1:] == keys[:-1]] // width).tolist()     # whole batches with a repeat
    segments = [(tail, n, ()), (0, head, before.tolist())]
    segments += [(head + b * batch, head + (b + 1) * batch, ()) for b in repeated]
    for a, b, outside in segments:
        if b - a < 2 and not len(outside):
            continue
        present = set(recs[a:b].tolist()) | set(outside)
        seen = set(outside)
        for p in range(a, b):
            r = int(recs[p])
            if r in seen:
                q = _donor(recs, r, present, a, head, batch, whole)
                if q is not None:
                    order[p], order[q] = order[q], order[p]
                    recs[p], recs[q] = recs[q], recs[p]
                    present.add(int(recs[p]))
            seen.add(int(recs[p]))


def _donor(recs: np.ndarray, record: int, present: set, segment_start: int, head: int, batch: int,
           whole: int) -> int | None:
    """A position in a whole batch (searched from the one after the segment on, cyclically) that does not hold
    `record` and whose record is not in `present`; None if there is none."""
    first = max(0, (segment_start - head) // batch + 1) if segment_start >= head else 0
    for k in range(whole):
        b = (first + k) % whole
        lo = head + b * batch
        if lo <= segment_start < lo + batch:
            continue
        members = recs[lo:lo + batch]
        if record in members:
            continue
        for q in range(lo, lo + batch):
            if int(recs[q]) not in present:
                return q
    return None


@dataclass
class ValidationSchedule:
    """Validation: one pass over the units in index order; rank r reads every world-th unit, in micro-batches that
    may end partial; worker w of W every W-th of them."""

    units: int
    micro_batch: int
    world_size: int = 1

    def epoch_length(self, epoch: int, rank: int = 0) -> int:
        return math.ceil(len(range(rank, self.units, self.world_size)) / self.micro_batch)

    def micro_batches(self, epoch: int, start: int, worker: int = 0, workers: int = 1, rank: int = 0) -> range:
        return range(start + worker, self.epoch_length(epoch, rank), workers)

    def batch_positions(self, micro: int, rank: int) -> np.ndarray:
        mine = len(range(rank, self.units, self.world_size))
        return np.arange(micro * self.micro_batch, min((micro + 1) * self.micro_batch, mine)) * self.world_size + rank

    def units_at(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)

    def candidates(self, position: int) -> Iterator[int]:
        yield int(position)


# ------------------------------------------------------------------------------------------ 6. examples
@dataclass(frozen=True)
class StreamConfig:
    method: Any
    ctx: Any                    # ExampleContext
    seed: int
    rank: int
    train: bool


class _EpochStream(IterableDataset):
    """One epoch of one rank: yields {"batch": collated, "stats": {...}} per micro-batch from each worker."""

    def __init__(self, cfg: StreamConfig, schedule: Schedule | ValidationSchedule, units: UnitTable):
        super().__init__()
        import multiprocessing as mp

        self.cfg, self.schedule, self.units = cfg, schedule, units
        self.shared_epoch, self.shared_start = mp.Value("q", 0), mp.Value("q", 0)   # set by ShardLoader.batches

    def __iter__(self) -> Iterator[dict]:
        epoch, start = int(self.shared_epoch.value), int(self.shared_start.value)
        worker, workers = _worker()
        for micro in self.schedule.micro_batches(epoch, start, worker, workers, rank=self.cfg.rank):
            batch = self._batch(self.schedule.batch_positions(micro, self.cfg.rank))
            if batch is not None:
                yield batch

    def _batch(self, positions: np.ndarray) -> dict | None:
        """The collated examples at `positions` with their counts; None for a validation batch of corrupt images."""
        stats: Counter = Counter()
        examples = [e for e in (self._example(int(p), stats) for p in positions) if e is not None]
        stats["examples"] += len(examples)
        return {"batch": default_collate(examples), "stats": dict(stats)} if examples else None

    def _example(self, position: int, stats: Counter) -> dict | None:
        found = self._decoded(position, stats)
        if found is None:
            return None
        record, image = found
        rng = random.Random(f"{self.cfg.seed}:{position}")
        # torch draws (random augmentations) become a function of the position too; the CPU generator only:
        # torch.manual_seed also queues lazy CUDA/XPU/MPS seeding, each with a traceback.format_stack() (~0.1 ms per
        # call, half a worker's CPU on small images)
        torch_seed = rng.getrandbits(63)
        if torch.utils.data.get_worker_info() is not None:
            torch.default_generator.manual_seed(torch_seed)
            return self.cfg.method.make_example(record, image, rng, self.cfg.ctx)
        with torch.random.fork_rng(devices=[]):                 # the main process's own RNG is left as it was
            torch.default_generator.manual_seed(torch_seed)
            return self.cfg.method.make_example(record, image, rng, self.cfg.ctx)

    def _decoded(self, position: int, stats: Counter):
        """(record, decoded image) of the unit at `position`; a corrupt image is a counted skip, replaced in training
        by the next unit of the pass that decodes (a counted repeat); None in validation."""
        for n, unit in enumerate(self.schedule.candidates(position)):
            key, record, jpg, shard = self.units.read(unit)
            try:
                image = read_image(jpg, path=f"{shard} sample {key}", record=key)
            except InputError as e:
                stats["corrupt_images_skipped"] += 1
                log.warning("skipping sample %s of %s: corrupt image (%s)", key, shard, e)
                if not self.cfg.train:
                    return None
                continue
            if n:
                stats["units_repeated"] += 1
            return record, image
        raise InputError(self.units.store.paths[0], None, "no image of this epoch's units decodes")


def _worker() -> tuple[int, int]:
    info = torch.utils.data.get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


# ------------------------------------------------------------------------------------------ the loader
class ShardLoader:
    """Batches of one method from `<shards_dir>/<split>-*.tar` through the shard index, one epoch at a time.

    A `train.loop.BatchSource`: `loader.epoch_length(epoch)` micro-batches of `batch_size` on this rank,
    `loader.batches(epoch, start)`. `batch_size` is the rank's micro-batch; the global batch (one optimiser step) is
    batch_size x world_size x accum_steps, which must be the trainer's. `pin_memory` (for a CUDA trainer): the
    workers' batches are copied into page-locked memory by the DataLoader's pinning thread, so the trainer's
    `non_blocking` copy to the device overlaps the step instead of staging through pageable memory.
    """

    def __init__(self, shards_dir: str | Path, split: str, method, ctx: ExampleContext, *, batch_size: int,
                 seed: int = 0, num_workers: int = 0, train: bool = True, epoch_unit: str = "image",
                 epoch_samples: int = 0, rank: int | None = None, world_size: int | None = None,
                 accum_steps: int = 1, pin_memory: bool = False):
        import webdataset as wds

        if batch_size < 1 or accum_steps < 1:
            raise ValueError(f"batch_size and accum_steps must be >= 1, got {batch_size}, {accum_steps}")
        if epoch_unit not in ("image", "method"):
            raise ValueError(f"epoch_unit must be 'image' or 'method', got {epoch_unit!r}")
        if epoch_unit == "method" and not train:
            raise ValueError("epoch_unit 'method' is for training loaders (validation is one pass over the images)")
        if epoch_samples < 0 or epoch_samples and not train:
            raise ValueError(f"epoch_samples must be >= 0 and only for training loaders, got {epoch_samples}")
        env_rank, env_world, _, _ = wds.utils.pytorch_worker_info()   # env RANK/WORLD_SIZE or torch.distributed
        self.rank = env_rank if rank is None else rank
        self.world_size = env_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self.method, self.ctx, self.batch_size, self.seed = method, ctx, batch_size, seed
        self.num_workers, self.train, self.accum_steps = num_workers, train, accum_steps
        self.pin_memory = pin_memory
        self.epoch_unit = method.epoch_unit if epoch_unit == "method" else "image"
        units = UnitTable(shards_dir, split, method, per_unit=self.epoch_unit != "image",
                          epoch_samples=epoch_samples, seed=seed)
        self.paths = units.store.paths
        self.num_samples, self.num_wanted = units.num_samples, units.num_wanted
        self.dropped_by_method, self.num_units = units.num_samples - units.num_wanted, len(units)
        log.info("method %s wants %d of %d %s samples (%d dropped by its filter); epoch unit %s: %d units%s",
                 method.name, self.num_wanted, self.num_samples, split, self.dropped_by_method, self.epoch_unit,
                 self.num_units, f" (a fixed seeded sample of {units.all_units})" if len(units) < units.all_units
                 else "")
        if train:
            self.schedule = Schedule(len(units), batch_size, self.world_size, accum_steps, seed, units.records)
        else:
            self.schedule = ValidationSchedule(len(units), batch_size, self.world_size)
        self.stats: Counter = Counter()
        self._loader = None
        self._stream = _EpochStream(StreamConfig(method, ctx, seed, self.rank, train), self.schedule, units)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accum_steps

    def epoch_length(self, epoch: int) -> int:
        """Micro-batches of `epoch` on this rank (training: the same on every rank)."""
        return self.schedule.epoch_length(epoch, self.rank)

    def steps(self, epochs: int) -> int:
        """Optimiser steps of a run of `epochs` epochs (training)."""
        return self.schedule.steps(epochs)

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """The micro-batches of `epoch` from index `start` on (resume), each a default-collated dict."""
        if not 0 <= start <= self.epoch_length(epoch):
            raise ValueError(f"start {start} outside 0..{self.epoch_length(epoch)} (micro-batches of epoch {epoch})")
        if start and not self.train:
            raise ValueError("resume (start > 0) is for training loaders")
        self._stream.shared_epoch.value, self._stream.shared_start.value = epoch, start
        if self.num_workers > 0:
            if self._loader is None:
                # a private generator: the DataLoader's worker seeds never consume the global torch RNG
                self._loader = torch.utils.data.DataLoader(
                    self._stream, batch_size=None, num_workers=self.num_workers, persistent_workers=True,
                    pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed))
            it = iter(self._loader)
        else:
            it = iter(self._stream)
        before = Counter(self.stats)
        for item in it:
            self.stats.update(item["stats"])
            self.stats["batches"] += 1
            yield item["batch"]
        delta = {k: v - before.get(k, 0) for k, v in self.stats.items() if v != before.get(k, 0)}
        log.info("epoch %d (%s, method %s): %s", epoch, "train" if self.train else "eval", self.method.name, delta)


# ------------------------------------------------------------------------------------------ interface 2: plan
def epoch_coverage(shards_dir: str | Path, split: str, method, *, global_batch: int, world_size: int,
                   num_workers: int, epoch_unit: str = "image", epoch_samples: int = 0, accum_steps: int = 1,
                   seed: int = 0, epochs: int = 1) -> dict:
    """What `ShardLoader` would read over `epochs` epochs at `world_size` ranks x `num_workers` workers, computed from
    the shard index without decoding an image, through the loader's own functions (`UnitTable`, `Schedule`).

    Returns {"units": N, "global_batch", "readers", "steps_per_epoch": ceil(N / G) (an epoch has this many steps or
    one fewer), "steps": optimiser steps of the `epochs` epochs, "seen" / "repeated": the fewest distinct units read
    of a pass and the most units read twice in one (N and 0 by construction; this checks it), "extra": units read
    beyond the epochs' passes (the last batch's fill, < G), "remainder": N mod G}. Corrupt images (replaced while
    training) are not modelled."""
    if global_batch % (world_size * accum_steps):
        raise ValueError(f"global batch {global_batch} does not split into {world_size} ranks x {accum_steps} "
                         f"accumulation steps")
    per_unit = epoch_unit == "method" and method.epoch_unit != "image"
    units = UnitTable(shards_dir, split, method, per_unit=per_unit, epoch_samples=epoch_samples, seed=seed)
    schedule = Schedule(len(units), global_batch // (world_size * accum_steps), world_size, accum_steps, seed,
                        units.records)
    return {**coverage(schedule, max(1, num_workers), epochs), "unit": method.epoch_unit if per_unit else "image"}


def positions_read(schedule: Schedule, workers: int, epochs: int = 1) -> np.ndarray:
    """Every stream position every rank x worker of `schedule` reads in `epochs` epochs (`Schedule.micro_batches` and
    `Schedule.positions`, as the loader's workers call them)."""
    read = []
    for epoch in range(epochs):
        for rank in range(schedule.world_size):
            for worker in range(workers):
                micro = np.fromiter(schedule.micro_batches(epoch, 0, worker, workers), dtype=np.int64)
                read.append(schedule.positions(micro, rank).ravel())
    return np.concatenate(read)


def coverage(schedule: Schedule, workers: int, epochs: int = 1) -> dict:
    """Units seen and repeated per pass when every rank x worker of `schedule` reads its share of `epochs` epochs
    (`Schedule.micro_batches` and `Schedule.positions`, as the loader's workers call them)."""
    n = schedule.units
    positions = positions_read(schedule, workers, epochs)
    passes = positions // n
    seen, repeated = [], []
    for p in range(epochs):
        units = schedule.units_at(positions[passes == p])
        distinct = len(np.unique(units))
        seen.append(distinct)
        repeated.append(len(units) - distinct)
    return {"units": n, "global_batch": schedule.global_batch, "readers": schedule.world_size * workers,
            "steps_per_epoch": -(-n // schedule.global_batch), "steps": schedule.steps(epochs),
            "seen": min(seen), "repeated": max(repeated), "extra": int((passes >= epochs).sum()),
            "remainder": n % schedule.global_batch}
