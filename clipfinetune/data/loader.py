"""The training loader: shards -> method batches, deterministic by (seed, epoch) and resumable exactly.

Pipeline per loader worker (a WebDataset pipeline; rank/world given to ShardLoader, else from
`webdataset.utils.pytorch_worker_info`, i.e. env RANK/WORLD_SIZE or torch.distributed; worker ids from torch):

    for each pass over the data (train: pass after pass until the epoch's batches are made):
        shard list (of the sources the method wants, index.json) shuffled by (seed, epoch, pass)
        -> this reader's share (`reader_shards`: whole shards, or every k-th sample of a shared one)
        -> wds.tarfile_to_samples -> json -> method.wants(record) filter
        -> shuffle buffer seeded by (seed, epoch, rank, worker, pass)
    -> skip (resume) -> PIL RGB decode (corrupt: counted skip) -> method.make_example(record, image, rng, ctx)
    -> default_collate per `batch_size` -> exactly `batches_per_epoch / max(1, num_workers)` batches

Decisions:
- **Epoch length without a DataLoader-wide count**: at construction the loader reads the shards' json
  members (tar headers are seeked over; no image is read or decoded) and counts the samples the method
  wants. `batches_per_epoch = ceil(wanted / (batch_size * world))`, rounded up to a multiple of the
  worker count (open_clip's rule). Every rank runs exactly that many batches (the shard stream is
  repeated, so a rank whose shards hold fewer samples repeats some): DDP ranks never wait on each other.
- **Determinism**: shard order, shuffle buffer and the per-example `rng` are seeded by strings of
  (seed, epoch, rank, worker, position); torch's DataLoader returns worker batches round-robin, in
  order. The same (seed, epoch, world size, num_workers, batch_size) give the same batches.
- **Resume** at (epoch, k): every worker skips its first k // W batches *before* decoding images (the
  filter and shuffle are replayed; they are cheap), the main process drops the remaining k % W. A
  corrupt image inside the skipped region would shift later batches by one sample; the `shards` stage
  verifies every image, so this can only come from on-disk damage after the stage ran.
- `make_example`'s rng: `random.Random("seed:epoch:rank:worker:n")` for the worker's n-th wanted sample;
  its first draw seeds the worker's torch RNG (workers only; with num_workers=0 torch's RNG is untouched).
- Statistics (samples seen, dropped by the method filter, corrupt images, repeats) are counted in the
  workers, travel with each batch and are summed in `ShardLoader.stats`; each epoch ends with a log line.
- **Persistent workers**: one DataLoader per loader, `persistent_workers=True`; the epoch and the resume
  skip reach the workers through shared `multiprocessing.Value`s (open_clip's SharedEpoch), so lazy
  per-worker resources (FSC-CLIP's spaCy + WordNet, ~10 s) load once per run, not once per epoch. Nothing
  is warmed in the main process before the fork: NLTK's WordNet reader keeps open file handles whose
  offsets forked workers would share. A worker re-seeds its own torch RNG before every example (from that
  example's rng), so a transform that draws from torch is deterministic and resumable too.
- Validation (`train=False`): one pass in shard order, no shuffle, partial last batches, no repeats.
- **Epoch unit** (`epoch_unit`): "image" (default) draws one example per wanted record per epoch (the method's
  `make_example` picks a caption/row with its rng). "method" iterates the method's own `epoch_unit` (caption,
  word-region pair; `Method.units`/`unit_record`): the epoch's length is the number of units, and ONE read of
  the shards yields every unit of every wanted record (`_unit_shuffle`: a shuffle buffer of records, each
  giving its units in an order seeded by (seed, epoch, key, pass), one at a time at random draws; a draw avoids
  records already in the current batch while the buffer holds others, so a batch rarely has sibling captions as
  false negatives). So every unit comes once per epoch (one worker and rank; with several, up to the shard
  imbalance images have too), memory is one shuffle buffer, and determinism and resume are those of image
  epochs: the unit position is the stream position.
- **Any ranks x workers**: with fewer shards than readers (ranks x workers), readers share a shard and keep
  every k-th sample of it (`reader_shards`); steps per epoch are the same on every rank (the count above).
- **Epoch sample** (`epoch_samples` = N > 0, fewer than the epoch's units): training runs on a FIXED subset of N
  units (images, or the method's units), drawn once per run with `random.Random(f"{seed}:epoch_samples")` from
  the sorted unit keys ("<key>" or "<key>#<unit>"); every epoch is one pass over that subset, in its own seeded
  order (FSC-CLIP App. A.3: "100K randomly sampled examples", 5 epochs over them). Units outside it are skipped
  before decoding and counted (`outside_epoch_sample`).
"""
from __future__ import annotations

import json
import logging
import math
import random
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, default_collate

from clipfinetune import boxes as boxlib
from clipfinetune.io import InputError, read_image

log = logging.getLogger(__name__)


class ExampleContext:
    """What `Method.make_example` may use, built once from the model (DEVELOPERS.md)."""

    def __init__(self, transform: Callable, tokenize: Callable, image_size: int | tuple[int, int],
                 tokenize_long: Callable | None = None, token_span: Callable | None = None,
                 random_geometry: bool = False):
        self.transform, self.tokenize, self.image_size = transform, tokenize, image_size
        self._tokenize_long, self._token_span = tokenize_long, token_span
        self.random_geometry = random_geometry      # `transform` crops at random: no box can follow its pixels

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


def wanted_sources(shards_dir: str | Path, split: str, method) -> list[str] | None:
    """The sources of `split` whose records `method` wants, from the shards stage's index.json: a source is read
    iff `method.wants` accepts the example record of one of its field signatures (`wants` looks at which fields
    a record carries, never at its source). None when the shards have no index (all shards are read)."""
    path = Path(shards_dir) / "index.json"
    if method is None or not path.is_file():
        return None
    index = json.loads(path.read_text()).get(split, {})
    return sorted(source for source, entry in index.items()
                  if any(method.wants(sig["example"]) for sig in entry["signatures"]))


def shard_paths(shards_dir: str | Path, split: str, method=None) -> list[str]:
    """The `split` shards, only those of the sources `method` wants when the shards have an index.json."""
    paths = sorted(str(p) for p in Path(shards_dir).glob(f"{split}-*.tar"))
    if not paths:
        raise InputError(shards_dir, split, f"no {split}-*.tar shards (run `dvc repro shards`)")
    sources = wanted_sources(shards_dir, split, method)
    if sources is not None:
        index = json.loads((Path(shards_dir) / "index.json").read_text())[split]
        names = {name for source in sources for name in index[source]["shards"]}
        paths = [p for p in paths if Path(p).name in names]
        if not paths:
            raise InputError(shards_dir, split, f"method {method.name!r} wants the records of no source (do "
                             f"`shards.sources` and the data stages whose tables it reads, `<stage>.sources`, "
                             f"include its corpus?)")
    return paths


def reader_shards(order: list[str], reader: int, readers: int) -> list[tuple[str, int, int]]:
    """(shard, part, parts) for reader `reader` of `readers` (rank x worker): with at least as many shards as
    readers, every `readers`-th shard whole (part 0 of 1; webdataset's split_by_node then split_by_worker when
    reader = rank + world * worker); with fewer, the readers share shard `reader % len(order)`, each keeping the
    samples whose position in it is `part` modulo `parts` (sample-level split), so any ranks x workers work."""
    if len(order) >= readers:
        return [(u, 0, 1) for u in order[reader::readers]]
    shard = reader % len(order)
    return [(order[shard], reader // len(order), len(range(shard, readers, len(order))))]


def iter_shard_records(path: str) -> Iterator[tuple[str, dict]]:
    """(key, json record) of every sample in one shard; image members are seeked over, never read."""
    with tarfile.open(path) as tf:
        for m in tf:
            if m.isfile() and m.name.endswith(".json"):
                yield m.name[:-len(".json")], json.loads(tf.extractfile(m).read())


def count_shards(paths: list[str], method, units: bool = False) -> dict:
    """One read of the shards' json members: per shard the samples ("totals"), the samples the method wants
    ("wanted") and, with `units`, the method's `units` summed over those ("units"); "most_units" (the most one
    record holds) and "first" ((shard, key) of the first wanted sample)."""
    out = {"totals": [], "wanted": [], "units": [], "most_units": 0, "first": None}
    for p in paths:
        n = w = k = 0
        for key, rec in iter_shard_records(p):
            n += 1
            if method.wants(rec):
                w += 1
                out["first"] = out["first"] or (p, key)
                if units:
                    u = method.units(rec)
                    k, out["most_units"] = k + u, max(out["most_units"], u)
        out["totals"].append(n)
        out["wanted"].append(w)
        out["units"].append(k)
    return out


def count_wanted(paths: list[str], method) -> tuple[list[int], list[int], tuple[str, str] | None]:
    """Per shard: (samples, samples the method wants), and (shard, key) of the first wanted sample."""
    c = count_shards(paths, method)
    return c["totals"], c["wanted"], c["first"]


def sample_units(paths: list[str], method, n: int, seed: int, per_unit: bool) -> frozenset[str]:
    """A fixed, seeded sample of `n` unit keys ("<key>#<unit>" if `per_unit`, else "<key>") of the wanted records."""
    keys = []
    for p in paths:
        for key, rec in iter_shard_records(p):
            if method.wants(rec):
                keys += [f"{key}#{u}" for u in range(method.units(rec))] if per_unit else [key]
    return frozenset(random.Random(f"{seed}:epoch_samples").sample(sorted(keys), n))


def _seeded(*parts) -> random.Random:
    return random.Random(":".join(str(p) for p in parts))


def _buffer_shuffle(items, bufsize: int, rng: random.Random):
    buf = []
    for x in items:
        if len(buf) < bufsize:
            buf.append(x)
            continue
        i = rng.randrange(bufsize)
        yield buf[i]
        buf[i] = x
    rng.shuffle(buf)
    yield from buf


def _shard_samples(url: str):
    """The samples of one shard, read once from start to end (the one place the epoch streams open a shard)."""
    import webdataset as wds

    return wds.tarfile_to_samples()(iter([{"url": url}]))


def _unit_shuffle(records, bufsize: int, rng: random.Random, batch_size: int, units_of):
    """epoch_unit "method" in one read: a shuffle buffer of records, each holding its units in a seeded order
    (`units_of(key, rec)`); every draw takes a random record's next unit, and a record leaves the buffer (its
    slot refilled from the stream) when its units are spent. So every unit of every record comes once, the
    shards are read once, and memory is one buffer of records, as for image epochs. A draw avoids records
    already in the current batch when the buffer holds another (no sibling captions as false negatives)."""
    stream = iter(records)
    buf: list[list] = []

    def refill():
        while len(buf) < bufsize:
            item = next(stream, None)
            if item is None:
                return
            key, jpg, rec = item
            units = list(units_of(key, rec))
            if units:                               # none: every unit outside the epoch sample
                buf.append([key, jpg, rec, units])

    refill()
    in_batch: set[str] = set()
    emitted = 0
    while buf:
        i = rng.randrange(len(buf))
        for j in range(len(buf)):                       # first record from i on that is not in this batch
            if buf[(i + j) % len(buf)][0] not in in_batch:
                i = (i + j) % len(buf)
                break
        key, jpg, rec, units = buf[i]
        unit = units.pop(0)
        yield key, jpg, rec, unit
        in_batch.add(key)
        emitted += 1
        if emitted % batch_size == 0:
            in_batch.clear()
        if not units:
            buf[i] = buf[-1]
            buf.pop()
            refill()


class _EpochStream(IterableDataset):
    """One epoch of one rank: yields {"batch": collated, "stats": {...}} per batch from each worker."""

    def __init__(self, cfg: dict, batches_per_worker: int | None):
        super().__init__()
        import multiprocessing as mp

        self.cfg, self.batches_per_worker = cfg, batches_per_worker
        self.shared_epoch, self.shared_skip = mp.Value("q", 0), mp.Value("q", 0)   # set by ShardLoader.batches

    def _pass_shards(self, p: int, reader: int, readers: int) -> list[tuple[str, int, int]]:
        order = list(self.cfg["paths"])
        if self.cfg["train"]:
            _seeded(self.cfg["seed"], self.epoch, "shards", p).shuffle(order)
            return reader_shards(order, reader, readers)
        return [(u, 0, 1) for u in order[reader::readers]]     # validation: each shard whole, by one reader

    def __iter__(self):
        cfg = self.cfg
        method, ctx, bs, train = cfg["method"], cfg["ctx"], cfg["batch_size"], cfg["train"]
        self.epoch, self.skip_batches = int(self.shared_epoch.value), int(self.shared_skip.value)
        rank, world = cfg["rank"], cfg["world_size"]
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader, readers = rank + world * worker, world * workers
        in_worker = torch.utils.data.get_worker_info() is not None     # never touch the main process's RNG
        stats: Counter = Counter()
        misses, seen = 0, set()

        unit_mode, subset = cfg["unit_mode"], cfg.get("subset")

        def count_repeat(key):
            if key in seen:
                stats["samples_repeated"] += 1
            seen.add(key)

        samples_in_share = 0

        def read(shards):
            nonlocal samples_in_share
            for url, part, parts in shards:
                for i, sample in enumerate(_shard_samples(url)):
                    if i % parts == part:
                        samples_in_share += 1
                        yield sample

        def wanted(raw):
            nonlocal misses
            for s in raw:
                rec, key = json.loads(s["json"]), s["__key__"]
                stats["samples_read"] += 1
                if not unit_mode:
                    count_repeat(key)
                if not method.wants(rec):
                    stats["dropped_by_method"] += 1
                    misses += 1
                    if misses > cfg["max_misses"]:
                        raise RuntimeError(f"rank {rank} worker {worker}: no sample wanted by method "
                                           f"{method.name!r} in {misses} consecutive samples")
                    continue
                misses = 0
                if subset is not None and not unit_mode and key not in subset:
                    stats["outside_epoch_sample"] += 1
                    continue
                yield key, s["jpg"], rec

        def units_of(key, rec, p):
            """The record's units in this pass's seeded order, those outside the epoch sample left out (counted)."""
            n_units = method.units(rec)
            units = _seeded(cfg["seed"], self.epoch, key, p, "units").sample(range(n_units), n_units)
            if subset is None:
                return units
            kept = [u for u in units if f"{key}#{u}" in subset]
            stats["outside_epoch_sample"] += n_units - len(kept)
            return kept

        def passes():
            # pass after pass over the shards (train); each pass is shuffled on its own, so an epoch
            # sees every sample of this worker's shards before any repeat
            p = 0
            while True:
                stream = wanted(read(self._pass_shards(p, reader, readers)))
                buffer_rng = _seeded(cfg["seed"], self.epoch, rank, worker, p, "buf")
                if unit_mode:           # epoch_unit "method": every unit of every record in one read (pass)
                    for key, jpg, rec, unit in _unit_shuffle(stream, cfg["shuffle_buffer"], buffer_rng, bs,
                                                             lambda key, rec, p=p: units_of(key, rec, p)):
                        count_repeat(f"{key}#{unit}")
                        yield f"{key}#{unit}", jpg, method.unit_record(rec, unit)
                elif train:
                    yield from _buffer_shuffle(stream, cfg["shuffle_buffer"], buffer_rng)
                else:
                    yield from stream
                if not train:
                    return
                if samples_in_share == 0:
                    raise RuntimeError(f"rank {rank} worker {worker}: its share of the shards holds no sample "
                                       f"({len(cfg['paths'])} shards for {readers} readers)")
                p += 1

        to_skip, n, batch, produced = self.skip_batches * bs, 0, [], self.skip_batches
        if self.batches_per_worker is not None and produced >= self.batches_per_worker:
            return
        stream = passes()
        for key, jpg, rec in stream:
            n += 1
            if n <= to_skip:
                continue
            try:
                image = read_image(jpg, path=f"shard sample {key}", record=key)
            except InputError as e:
                stats["corrupt_images_skipped"] += 1
                log.warning("skipping sample %s: corrupt image (%s)", key, e)
                continue
            rng = _seeded(cfg["seed"], self.epoch, rank, worker, n)
            if in_worker:   # torch draws (random augmentations) become a function of the sample's position too
                # the CPU generator only: torch.manual_seed also queues lazy CUDA/XPU/MPS seeding, each with a
                # traceback.format_stack() (~0.1 ms per call, half a worker's CPU on small images); a loader
                # worker draws from the CPU generator alone, whose state is the same either way
                torch.default_generator.manual_seed(rng.getrandbits(63))
            batch.append(method.make_example(rec, image, rng, ctx))
            if len(batch) == bs:
                yield {"batch": default_collate(batch), "stats": dict(stats)}
                stats.clear()
                batch, produced = [], produced + 1
                if self.batches_per_worker is not None and produced >= self.batches_per_worker:
                    return
        if batch and not train:
            yield {"batch": default_collate(batch), "stats": dict(stats)}


class ShardLoader:
    """Batches of one method from `<shards_dir>/<split>-*.tar`, one epoch at a time.

    A `train.loop.BatchSource`: `len(loader)` batches per epoch on this rank, `loader.batches(epoch, start)`.
    """

    def __init__(self, shards_dir: str | Path, split: str, method, ctx: ExampleContext, *, batch_size: int,
                 seed: int = 0, num_workers: int = 0, shuffle_buffer: int = 1000, train: bool = True,
                 epoch_unit: str = "image", epoch_samples: int = 0, rank: int | None = None,
                 world_size: int | None = None):
        import webdataset as wds

        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if epoch_unit not in ("image", "method"):
            raise ValueError(f"epoch_unit must be 'image' or 'method', got {epoch_unit!r}")
        if epoch_unit == "method" and not train:
            raise ValueError("epoch_unit 'method' is for training loaders (validation is one pass over the images)")
        self.paths = shard_paths(shards_dir, split, method)
        self.method, self.ctx, self.batch_size, self.seed = method, ctx, batch_size, seed
        self.num_workers, self.train = num_workers, train
        env_rank, env_world, _, _ = wds.utils.pytorch_worker_info()   # env RANK/WORLD_SIZE or torch.distributed
        self.rank = env_rank if rank is None else rank
        self.world_size = env_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self.epoch_unit = method.epoch_unit if epoch_unit == "method" else "image"
        counts = count_shards(self.paths, method, units=self.epoch_unit != "image")   # one read for both counts
        totals, wanted = counts["totals"], counts["wanted"]
        self.num_samples, self.num_wanted = sum(totals), sum(wanted)
        self.shard_wanted = dict(zip(self.paths, wanted))
        if self.num_wanted == 0:
            raise InputError(shards_dir, split, f"method {method.name!r} wants none of the {self.num_samples} samples")
        log.info("method %s wants %d of %d %s samples (%d dropped by its filter)", method.name,
                 self.num_wanted, self.num_samples, split, self.num_samples - self.num_wanted)
        self.num_units = self.num_wanted
        if self.epoch_unit != "image":
            self.num_units, unit_passes = sum(counts["units"]), counts["most_units"]
            log.info("epoch unit %s: %d units in the %d wanted samples (up to %d in one)", self.epoch_unit,
                     self.num_units, self.num_wanted, unit_passes)
        subset = None
        if epoch_samples < 0 or epoch_samples and not train:
            raise ValueError(f"epoch_samples must be >= 0 and only for training loaders, got {epoch_samples}")
        if 0 < epoch_samples < self.num_units:
            subset = sample_units(self.paths, method, epoch_samples, seed, per_unit=self.epoch_unit != "image")
            log.info("epoch sample: a fixed seeded %d of the %d %s units, every epoch", epoch_samples,
                     self.num_units, self.epoch_unit)
            self.num_units = epoch_samples
        w = max(1, num_workers)
        if train:
            nb = math.ceil(self.num_units / (batch_size * self.world_size))
            self.batches_per_epoch = math.ceil(nb / w) * w
        else:
            self.batches_per_epoch = self._eval_batches(w)
        self.stats: Counter = Counter()
        self._loader = None
        cfg = {"paths": self.paths, "seed": seed, "train": train, "method": method, "ctx": ctx,
                     "batch_size": batch_size, "shuffle_buffer": shuffle_buffer,
                     "max_misses": 2 * self.num_samples + 1, "unit_mode": self.epoch_unit != "image",
                     "rank": self.rank, "world_size": self.world_size,
                     **({"subset": subset} if subset is not None else {})}
        self._stream = _EpochStream(cfg, self.batches_per_epoch // w if train else None)

    def _eval_batches(self, w: int) -> int:
        readers = self.world_size * w
        return sum(math.ceil(sum(self.shard_wanted[p] for p in self.paths[self.rank + self.world_size * i::readers])
                             / self.batch_size) for i in range(w))

    def __len__(self) -> int:
        return self.batches_per_epoch

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        """The batches of `epoch` from index `start` on (resume), each a default-collated dict."""
        start_batch = start
        if not 0 <= start_batch <= self.batches_per_epoch:
            raise ValueError(f"start_batch {start_batch} outside 0..{self.batches_per_epoch}")
        if start_batch and not self.train:
            raise ValueError("resume (start_batch > 0) is for training loaders")
        w = max(1, self.num_workers)
        k0 = start_batch // w * w
        self._stream.shared_epoch.value, self._stream.shared_skip.value = epoch, k0 // w
        if self.num_workers > 0:
            if self._loader is None:
                # a private generator: the DataLoader's worker seeds never consume the global torch RNG
                self._loader = torch.utils.data.DataLoader(
                    self._stream, batch_size=None, num_workers=self.num_workers, persistent_workers=True,
                    generator=torch.Generator().manual_seed(self.seed))
            it = iter(self._loader)
        else:
            it = iter(self._stream)
        before = Counter(self.stats)
        for i, item in enumerate(it, start=k0):
            self.stats.update(item["stats"])
            if i >= start_batch:
                self.stats["batches"] += 1
                yield item["batch"]
        delta = {k: v - before.get(k, 0) for k, v in self.stats.items() if v != before.get(k, 0)}
        log.info("epoch %d (%s, method %s): %s", epoch, "train" if self.train else "eval", self.method.name, delta)
