"""The evaluation suite's encoding split into fixed batches that any rank can compute (stage eval@<model>).

Why the split is the encoding: the forwards (every image, crop and text of every benchmark) are nearly all of an
evaluation's time; scoring (similarities, ranks, metrics) is cheap and needs whole sets, so it runs once, on rank 0.

1. `plan_batches`: the suite runs once with `RecordingEncoder`s, which compute nothing (they answer with
   placeholder vectors) but record every batch the real `Encoder` would compute, in the order it would: the
   images a benchmark asks for that no earlier one encoded, `batch_size` at a time; texts sorted by token count
   as `Encoder.texts` sorts them; box regions per chunk of images. No benchmark chooses what to encode from
   embedding values, so this is exactly the lazy run's sequence of batches.
2. Each batch is a work unit (`clipfinetune.parts`): rank r computes units r, r + N, ... (images decoded in
   DataLoader workers, `encode_unit`) and writes their embeddings as part files.
3. Rank 0 loads every unit into the `Encoder` caches (`fill_encoders`) and runs the suite for real: every
   lookup hits the cache, computed by the same batches as a lazy one-process run, so on the CPU the metrics and
   item outcomes are byte-identical to it whatever the number of ranks (fixed torch threads: `eval.threads`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from clipfinetune.eval.encode import Encoder, load_image, regions_key, text_batches


def _placeholder(key, dim: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") & ((1 << 63) - 1)
    return F.normalize(torch.randn(dim, generator=torch.Generator().manual_seed(seed)), dim=-1)


class RecordingEncoder(Encoder):
    """An `Encoder` that records the batches the real one would compute (`plan`) and answers with placeholder unit
    vectors (deterministic per key), so the suite runs through without a forward. `tag`: which model (the
    evaluated one or the box-classification text model)."""

    def __init__(self, model, batch_size: int, tag: str, plan: list, dim: int):
        super().__init__(model, batch_size)
        self.tag, self.plan, self.dim = tag, plan, dim

    def images(self, keys):
        keys = [(str(p), None if c is None else tuple(float(v) for v in c)) for p, c in keys]
        todo = list(dict.fromkeys(k for k in keys if k not in self._images))
        for s in range(0, len(todo), self.batch_size):
            chunk = todo[s:s + self.batch_size]
            self.plan.append({"kind": "images", "model": self.tag, "resize": self.resize_mode,
                              "keys": [[p, None if c is None else list(c)] for p, c in chunk]})
            self._images.update((k, _placeholder(k, self.dim)) for k in chunk)
        return torch.stack([self._images[k] for k in keys]) if keys else torch.zeros(0, 0)

    def texts(self, texts):
        texts = [str(t) for t in texts]
        todo = list(dict.fromkeys(t for t in texts if t not in self._texts))
        if todo:
            for rows in text_batches(self.model.tokenize(todo), self.batch_size):
                chunk = [todo[i] for i in rows]
                self.plan.append({"kind": "texts", "model": self.tag, "texts": chunk})
                self._texts.update((t, _placeholder(t, self.dim)) for t in chunk)
        return torch.stack([self._texts[t] for t in texts]) if texts else torch.zeros(0, 0)

    def regions(self, images):
        out = []
        for s in range(0, len(images), max(1, self.batch_size)):
            chunk = [(str(p), torch.as_tensor(b, dtype=torch.float32).reshape(-1, 4).tolist())
                     for p, b in images[s:s + self.batch_size]]
            self.plan.append({"kind": "regions", "model": self.tag, "images": chunk})
            out += [_placeholder((p, i), self.dim) for p, b in chunk for i in range(len(b))]
        return torch.stack(out) if out else torch.zeros(0, 0)


def plan_batches(model, evalsets: dict, batch_size: int, text_model=None, text_encoder: str = "own",
                 **suite_args) -> list[dict]:
    """Every batch the suite's encoders would compute, in order (step 1 above): the suite run over
    `RecordingEncoder`s. That pass scores placeholder vectors, so its per-benchmark log lines (chance-level numbers)
    are kept out of the log; warnings still show."""
    from clipfinetune.eval.suite import evaluate_model, make_encoders

    plan: list = []
    dim = embed_dim(model)
    recorders = make_encoders(model, text_model, text_encoder, batch_size,
                              new=lambda m, b, tag: RecordingEncoder(m, b, tag, plan, dim))
    with _quiet(logging.getLogger("clipfinetune.eval.suite")):
        evaluate_model(model, evalsets, batch_size, text_model, text_encoder, encoders=recorders, **suite_args)
    return plan


@contextlib.contextmanager
def _quiet(logger: logging.Logger):
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def unit_id(unit: dict) -> str:
    """A work unit's id in its part file: its kind and a digest of what it encodes."""
    return (f"{unit['kind']}-{unit['model']}-"
            + hashlib.sha256(json.dumps(unit, sort_keys=True).encode()).hexdigest()[:16])


def embed_dim(model) -> int:
    with torch.inference_mode():
        return int(model.encode_text(model.tokenize(["a"]).to(_device(model)), normalize=True).shape[-1])


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class _UnitImages(Dataset):
    """The decoded, transformed image batch of each image / regions unit (a DataLoader worker decodes one unit)."""

    def __init__(self, units: list[dict], encoders: dict[str, Encoder]):
        self.units, self.encoders = units, encoders

    def __len__(self):
        return len(self.units)

    def __getitem__(self, i):
        unit = self.units[i]
        enc = self.encoders[unit["model"]]
        if unit["kind"] == "images":
            transform = enc.with_resize(unit["resize"]).transform
            return torch.stack([transform(load_image(p, c)) for p, c in unit["keys"]]), []
        if unit["kind"] == "regions":
            pils = [load_image(p) for p, _ in unit["images"]]
            return torch.stack([enc.with_resize("squash").transform(im) for im in pils]), [im.size for im in pils]
        return torch.zeros(0), []


def unit_images(units: list[dict], encoders: dict[str, Encoder], workers: int = 0) -> DataLoader:
    """(uint8 pixels [n, 3, H, W], image sizes of a regions unit) of each unit, in order, decoded and transformed in
    `workers` DataLoader workers (pinned for a CUDA model); a text unit gives an empty tensor."""
    return DataLoader(_UnitImages(units, encoders), batch_size=None, num_workers=workers,
                      pin_memory=any(_device(e.model).type == "cuda" for e in encoders.values()))


@torch.inference_mode()
def encode_units(units: list[dict], encoders: dict[str, Encoder], workers: int = 0):
    """(index in `units`, result) for each unit, in order: {"emb": [n, D] fp32 CPU tensor} computed exactly as
    `Encoder.images` / `texts` / `regions` compute that batch. Images decoded in `workers` DataLoader workers."""
    from clipfinetune.boxes import resize_boxes

    for i, (x, sizes) in enumerate(unit_images(units, encoders, workers)):
        unit = units[i]
        model = encoders[unit["model"]].model
        device = _device(model)
        if unit["kind"] == "images":
            emb = F.normalize(model.encode_image(x.to(device, non_blocking=True), normalize=True).float(),
                              dim=-1).cpu()
        elif unit["kind"] == "texts":
            tokens = model.tokenize(unit["texts"]).to(device)
            emb = F.normalize(model.encode_text(tokens, normalize=True).float(), dim=-1).cpu()
        else:
            boxes = [resize_boxes(torch.tensor(b, dtype=torch.float32).reshape(-1, 4), size, model.image_size)
                     .to(device) for size, (_, b) in zip(sizes, unit["images"])]
            emb = F.normalize(model.region_features(x.to(device, non_blocking=True), boxes).float(), dim=-1).cpu()
        yield i, {"emb": emb}


def fill_encoders(units: list[dict], results: list[dict], encoders: dict[str, Encoder]) -> None:
    """Put every unit's embeddings into the caches of `encoders` (by tag), where the suite's lookups find them."""
    for unit, res in zip(units, results, strict=True):
        enc, emb = encoders[unit["model"]], res["emb"]
        if unit["kind"] == "images":
            cache = enc.with_resize(unit["resize"])._images
            cache.update(zip(((p, None if c is None else tuple(c)) for p, c in unit["keys"]), emb))
        elif unit["kind"] == "texts":
            enc._texts.update(zip(unit["texts"], emb))
        else:
            enc._regions[regions_key(unit["images"])] = emb
