"""Evaluation images in the training set: the one place that compares them (`validate` and stage `shards` call it).

Two tests, per configured evaluation set:
- **COCO id.** COCO numbers an image once for all its releases: `COCO_val2014_000000000042.jpg` and
  `train2017/000000000042.jpg` are the same picture, and Karpathy's `dataset_coco.json` carries it as `cocoid`.
  Training ids come from the coco reader's image_id (COCO's `images[].id`; Karpathy's reader names files by
  cocoid); evaluation ids from the file names the benchmark's own
  reader resolves (`[COCO_<split>_]<12 digits>.jpg`, COCO's naming; any other name has no id). This is what
  catches train2017 against the Karpathy 5K test (drawn from val2014) even though the files differ.
- **Content.** The BLAKE2b digest of the image bytes, so a renamed or re-foldered copy is caught whatever the
  dataset. Only files whose byte size equals some file's size on the other side are hashed (equal bytes have
  equal sizes), and digests are cached by (path, size, mtime) in `<cache_dir>/digests.sqlite`, so a re-check
  hashes nothing. A re-encoded copy (other bytes) is not caught by content: ids are the only guard there.
  Not covered: ARO's VG images that are also COCO images (VG ids, no COCO id in ARO's files).

Evaluation images are listed by `clipfinetune.data.evalsets.sets.read_set`, the reader the evaluation scores each set
through, so the check sees exactly the files a benchmark scores.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from clipfinetune.data.evalsets.sets import read_set
from clipfinetune.data.readers.coco import coco_id_of
from clipfinetune.digests import DigestCache
from clipfinetune.io import InputError

IMAGES_NOT_FILES = ("wds",)   # readers whose images live inside archives (Record.data), not as files
SHOWN = 5            # ids named in the error per overlapping set


@dataclass(frozen=True)
class ImageRef:
    path: str
    coco_id: int | None = None


@dataclass
class Overlap:
    eval_set: str                     # e.g. "retrieval.real"
    by_id: list[int] = field(default_factory=list)          # COCO ids in both
    by_content: list[tuple[str, str]] = field(default_factory=list)   # (training path, evaluation path), same bytes
    images: set = field(default_factory=set)                          # the evaluation paths found either way

    @property
    def count(self) -> int:
        """Distinct evaluation images found in training (by id, by content, or both)."""
        return len(self.images)

    def __str__(self) -> str:
        parts = []
        if self.by_id:
            ids = ", ".join(str(i) for i in sorted(self.by_id)[:SHOWN])
            parts.append(f"{len(self.by_id)} by COCO id (first: {ids})")
        if self.by_content:
            pairs = "; ".join(f"{t} == {e}" for t, e in sorted(self.by_content)[:SHOWN])
            parts.append(f"{len(self.by_content)} by content (first: {pairs})")
        return f"evaluation set {self.eval_set}: {self.count} of its images are training images - " + ", ".join(parts)


class LeakageError(ValueError):
    """Training images that an evaluation set scores: the run would report inflated numbers."""

    def __init__(self, overlaps: list[Overlap]):
        self.overlaps = overlaps
        super().__init__("training images overlap evaluation sets (use a leak-free split, e.g. Karpathy "
                         "train+restval for the Karpathy test, train2017 only with val2017):\n  "
                         + "\n  ".join(str(o) for o in overlaps))


# ---------------------------------------------------------------- training images
def training_images(sources: dict, splits=None, unchecked: list | None = None, records: dict | None = None
                    ) -> list[ImageRef]:
    """The training images of `sources` ({name: params `sources.<name>`}) whose split is in `splits` (the shards
    stage's selection, `readers.in_splits`), read by their readers (or taken from `records`, {name: [Record]}, when
    the caller has read them). COCO id: the coco reader's `image_id` (COCO's `images[].id`); any other reader's only
    by COCO's file naming (Karpathy's COCO split: `COCO_<split>_<cocoid>.jpg`). Sources whose images are not files
    (the `wds` reader's tars) are named in `unchecked`: not compared."""
    from clipfinetune.data.readers import in_splits, read_source

    out: list[ImageRef] = []
    for name, spec in (sources or {}).items():
        if spec.get("reader") in IMAGES_NOT_FILES:
            if unchecked is not None:
                unchecked.append(name)
            continue
        source_records = records[name] if records is not None else read_source(name, spec)
        is_coco = spec.get("reader") == "coco"
        out += [ImageRef(str(r.path), int(r.image_id) if is_coco else coco_id_of(r.image))
                for r in source_records if in_splits(r, splits)]
    return out


# ---------------------------------------------------------------- evaluation images
def evaluation_sets(evalsets: dict | None, unreadable: dict | None = None) -> dict[str, list[ImageRef]]:
    """{"<task>.<set>": images} for every configured set of `eval.evalsets`, as its benchmark's reader lists the images
    it scores (`clipfinetune.data.evalsets.sets.read_set`). A set whose files cannot be read
    (e.g. a sample-world set the `sample` stage has not written yet: it cannot hold a real training image) is left
    out and its error put in `unreadable` when given, else raised."""
    out = {}
    for task, sets in (evalsets or {}).items():
        for name, cfg in (sets or {}).items():
            if not cfg:
                continue
            try:
                out[f"{task}.{name}"] = [ImageRef(p, coco_id_of(p)) for p in read_set(task, dict(cfg), name).images]
            except (InputError, OSError) as e:
                if unreadable is None:
                    raise
                unreadable[f"{task}.{name}"] = str(e)
    return out


# ---------------------------------------------------------------- the comparison
def _stats(refs: Iterable[ImageRef]) -> dict[str, os.stat_result]:
    out = {}
    for r in refs:
        try:
            out[r.path] = os.stat(r.path)
        except OSError:       # a missing training image is the shards stage's counted skip, not a leak
            continue
    return out


def find_overlaps(train: list[ImageRef], evals: dict[str, list[ImageRef]], cache_dir=None,
                  content: bool = True) -> tuple[list[Overlap], dict]:
    """Overlaps of the training images with each evaluation set (sets without any are left out), and what the
    check cost: {"train_images", "eval_images", "files_hashed", "digests_reused"}."""
    train_ids = {r.coco_id for r in train if r.coco_id is not None}
    overlaps = {name: Overlap(name, by_id=sorted({r.coco_id for r in refs if r.coco_id in train_ids}),
                              images={r.path for r in refs if r.coco_id in train_ids})
                for name, refs in evals.items()}
    cost = {"train_images": len(train), "eval_images": sum(len(v) for v in evals.values()),
            "files_hashed": 0, "digests_reused": 0}
    if content:
        train_st = _stats(train)
        eval_st = _stats(r for refs in evals.values() for r in refs)
        sizes = {st.st_size for st in train_st.values()} & {st.st_size for st in eval_st.values()}
        cache = DigestCache(cache_dir)
        try:
            by_digest: dict[str, str] = {}
            for path, st in train_st.items():
                if st.st_size in sizes:
                    by_digest.setdefault(cache.digest(path, st), path)
            for name, refs in evals.items():
                for r in dict.fromkeys(refs):
                    st = eval_st.get(r.path)
                    if st is not None and st.st_size in sizes:
                        hit = by_digest.get(cache.digest(r.path, st))
                        if hit is not None:
                            overlaps[name].by_content.append((hit, r.path))
                            overlaps[name].images.add(r.path)
            cost["files_hashed"], cost["digests_reused"] = cache.hashed, cache.reused
        finally:
            cache.close()
    return [o for o in overlaps.values() if o.count], cost


def refuse(overlaps: list[Overlap]) -> None:
    if overlaps:
        raise LeakageError(overlaps)
