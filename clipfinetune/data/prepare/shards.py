"""WebDataset shards: one sample per training image, carrying every annotation the methods need.

A sample (DEVELOPERS.md "A shard sample"): `__key__` = `<source>_<image_id>` (dots replaced by `-`:
WebDataset splits keys at the first dot), `jpg` = the original file bytes (never re-encoded), `json` =
all annotations (sorted keys, compact, UTF-8), `txt` = one caption so `open_clip_train` reads the shards
as they are. Decisions:
- Records come from the sources the stage lists (`clipfinetune.data.readers`, any format); `source` = the
  source's name. Each prepared table is attached only to records of the source it was prepared from.
- `txt`: a record with short captions -> its first caption (caption_index 0); a long-caption record (DOCCI)
  -> the summary sentence (sentence 0; the whole long caption when it has no sentences row). Long-caption
  records have `captions: []` (DOCCI has no short captions; the summary is `sentences[0]`). A record with
  neither is skipped and counted (`<source>_empty_long_caption_skipped`).
- Shards per source: `<split>-<source>-%06d.tar` (one flat folder, so open_clip's sizes.json still names
  every shard), so a method that wants only some sources' records reads only their shards.
- `index.json` (`index_shards`, read back from the tars once they are written, inside the stage's atomic
  folder): per split and source, its shards; per *field signature* (which of the fields FIELDS are
  non-empty) the count and one example record, on which the loader evaluates a method's `wants` to pick the
  sources (`wants` looks at fields, never at `source`); and the record table: per record its key, shard and
  each member's byte offset and size, so a reader reads any one record by offset (as webdataset's wids does)
  and an epoch can hand any unit to any rank and worker. Hand-made shards get theirs with `write_index`.
- Within a source, samples are ordered by SHA-1 of the key. Split: a sample is `val` iff the first 8 hex digits of
  SHA-1(key) / 2^32 < `val_fraction` (fixed per image, independent of the rest).
- Shard size: `maxcount` samples. The loader reads records by offset, so coverage does not depend on it; a few
  hundred MB to a few GB per shard keeps the file count small (open_clip_train reads whole shards per worker).
- Every annotation row is checked against the sample before it is attached: a word region or negative
  whose caption text differs from `captions[caption_index]`, or a local pair whose sentence index is out
  of range, is dropped and counted (stale intermediates), never attached to the wrong text.
- local_pairs: only rows with `chosen` and kind `region` become `local_pair` (0 or 1 entries; the
  global image winning means "no local pair", as in GOAL's `_del_org` files). Two chosen rows -> error.
- Images: a missing or undecodable file (JPEG decoded in draft mode, which reads the whole stream), or
  one whose size disagrees with the annotation's width/height, is skipped and counted.
- Byte-identical re-runs: ShardWriter(mtime=0), fixed tar user/group/mode, deterministic JSON.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pandas as pd

from clipfinetune.io import ImageTooLarge, InputError, checked_image_size

SPLITS = ("train", "val")
FIELDS = ("captions", "long_caption", "word_regions", "sentences", "local_pair", "negatives")   # index.json signatures
INDEX = "index.json"
REQUIRED = {
    "word_regions": ["image_id", "caption_index", "caption", "word", "char_start", "char_end", "category",
                     "x0", "y0", "x1", "y1"],
    "sentences": ["image_id", "source", "long_caption", "sentence_index", "text", "char_start", "char_end"],
    "local_pairs": ["image_id", "sentence_index", "x0", "y0", "x1", "y1", "chosen", "kind"],
    "negatives": ["image_id", "caption_index", "caption", "type", "negative"],
}


def read_prepared(path: str | os.PathLike, kind: str, producer: str) -> pd.DataFrame:
    """A prepared parquet with its schema checked; absent -> a clear error naming the producing stage."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, None, f"missing: it is produced by stage `{producer}` (run `dvc repro {producer}`)")
    frame = pd.read_parquet(path)
    missing = [c for c in REQUIRED[kind] if c not in frame.columns]
    if missing:
        raise InputError(path, None, f"{kind} parquet lacks columns {missing}")
    return frame


def sample_key(source: str, image_id) -> str:
    return f"{source}_{image_id}".replace(".", "-")


def key_digest(key: str) -> str:
    return hashlib.sha1(key.encode("utf-8")).hexdigest()


def split_of(key: str, val_fraction: float) -> str:
    return "val" if int(key_digest(key)[:8], 16) / 2 ** 32 < val_fraction else "train"


def _box(r) -> list[float]:
    return [float(r.x0), float(r.y0), float(r.x1), float(r.y1)]


def _group(frame: pd.DataFrame, key=lambda v: str(v)) -> dict:
    out = defaultdict(list)
    for r in frame.itertuples(index=False):
        out[key(r.image_id)].append(r)
    return out


def _word_regions(rows, captions: tuple[str, ...], counts: Counter) -> list[dict]:
    regions = []
    for r in sorted(rows, key=lambda r: (r.caption_index, r.char_start)):
        k = int(r.caption_index)
        if not (0 <= k < len(captions)) or captions[k] != r.caption or captions[k][r.char_start:r.char_end] != r.word:
            counts["word_regions_stale_dropped"] += 1
            continue
        regions.append({"caption_index": k, "word": r.word, "char_span": [int(r.char_start), int(r.char_end)],
                        "box": _box(r), "category": r.category})
    return regions


def _negatives(rows, captions: tuple[str, ...], counts: Counter) -> list[dict]:
    groups: dict[tuple[int, str], list[str]] = {}
    for r in rows:   # row order within (caption_index, type) is the producer's order
        k = int(r.caption_index)
        if not (0 <= k < len(captions)) or captions[k] != r.caption:
            counts["negatives_stale_dropped"] += 1
            continue
        groups.setdefault((k, str(r.type)), []).append(str(r.negative))
    return [{"caption_index": k, "type": t, "texts": texts} for (k, t), texts in sorted(groups.items())]


def _local_pair(rows, n_sentences: int, image_id: str, counts: Counter) -> list[dict]:
    chosen = [r for r in rows if bool(r.chosen)]
    if len(chosen) > 1:
        raise InputError("local_pairs.parquet", image_id, f"{len(chosen)} chosen local pairs (at most 1)")
    local = []
    for r in chosen:
        if r.kind != "region":
            counts["local_pair_global_wins"] += 1
        elif not (0 <= int(r.sentence_index) < n_sentences):
            counts["local_pair_stale_dropped"] += 1
        else:
            local.append({"sentence_index": int(r.sentence_index), "box": _box(r)})
    return local


class Annotations:
    """The prepared tables, each attached only to the records of the source it was prepared from:
    `prepared_from` = {"word_regions": [sources], "negatives": [sources], "local_pairs": [sources], "sentences":
    [sources]} (each the sources its stage prepared; [] = the stage did not run; sentences also name their source
    in a column). A table whose sources are not among `sources` (the stage's)
    is not read, so a stage over, say, image-text pairs alone needs no LISM or word-region outputs."""

    PRODUCERS: ClassVar[dict[str, str]] = {
        "word_regions": "word_regions", "negatives": "negatives", "local_pairs": "lism", "sentences": "sentences"}

    def __init__(self, prepared_dir, prepared_from: dict, sources):
        prepared, sources = Path(prepared_dir), set(sources)
        self.sources = {k: {v} if isinstance(v, str) else set(v) for k, v in prepared_from.items()}
        self.negatives_matched = 0

        def table(kind: str, used: bool) -> dict:
            if not used:
                return {}
            frame = read_prepared(prepared / f"{kind}.parquet", kind, self.PRODUCERS[kind])
            if kind == "sentences":
                return {source: _group(rows) for source, rows in frame.groupby("source")}
            return _group(frame)

        for kind in ("word_regions", "negatives", "local_pairs", "sentences"):
            setattr(self, kind, table(kind, bool(self.sources.get(kind, set()) & sources)))

    def rows(self, table: str, record) -> list:
        if record.source not in self.sources.get(table, ()):
            return []
        return getattr(self, table).get(str(record.image_id), [])


def shard_record(record, notes: Annotations, counts: Counter) -> dict | None:
    """A reader's `Record` with its prepared annotations -> what `write_shards` writes; None = skipped (counted)."""
    image_id, captions = str(record.image_id), tuple(record.captions)
    rows = sorted(notes.sentences.get(record.source, {}).get(image_id, []), key=lambda r: r.sentence_index)
    long_caption = rows[0].long_caption if rows else (record.long_caption or "").strip()
    if not captions and not long_caption:
        counts[f"{record.source}_empty_long_caption_skipped"] += 1
        return None
    if long_caption and not rows:
        counts[f"{record.source}_without_sentences"] += 1
    sentences = [{"text": r.text, "char_span": [int(r.char_start), int(r.char_end)]} for r in rows]
    negatives = notes.rows("negatives", record)
    notes.negatives_matched += len(negatives)
    meta = {"image_id": image_id, "source": record.source, "captions": list(captions), "long_caption": long_caption,
            "word_regions": _word_regions(notes.rows("word_regions", record), captions, counts),
            "sentences": sentences,
            "local_pair": _local_pair(notes.rows("local_pairs", record), len(sentences), image_id, counts),
            "negatives": _negatives(negatives, captions, counts)}
    txt = captions[0] if captions else sentences[0]["text"] if sentences else long_caption
    return {"key": sample_key(record.source, image_id), "record": record, "size": record.size, "json": meta,
            "txt": txt}


def open_clip_pattern(shard_paths: list[str]) -> str:
    """open_clip's --train-data for these `<split>-<source>-%06d.tar` shards: one brace range per source, joined
    by `::` (open_clip's list separator); sizes.json in their folder gives the counts."""
    ranges: dict[str, list[str]] = {}
    for p in sorted(shard_paths):
        stem, number = str(p)[:-len(".tar")].rsplit("-", 1)
        ranges.setdefault(stem, []).append(number)
    return "::".join(f"{stem}-{{{n[0]}..{n[-1]}}}.tar" if len(n) > 1 else f"{stem}-{n[0]}.tar"
                     for stem, n in ranges.items())


def write_shards(records: list[dict], out_dir: str | os.PathLike, *, maxcount: int, val_fraction: float,
                 counts: Counter) -> dict:
    """Write {train,val}-<source>-%06d.tar into out_dir; returns {split: {shard name: count}} (sizes.json)."""
    import webdataset as wds

    out_dir = Path(out_dir)
    records = sorted(records, key=lambda r: (r["json"]["source"], key_digest(r["key"]), r["key"]))
    keys = [r["key"] for r in records]
    if len(set(keys)) != len(keys):
        dup = next(k for k, n in Counter(keys).items() if n > 1)
        raise InputError(out_dir, dup, "two samples share a key")
    sizes: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    writers: dict[tuple[str, str], object] = {}

    def writer(split: str, source: str):
        if (split, source) not in writers:
            writers[split, source] = wds.ShardWriter(str(out_dir / f"{split}-{source}-%06d.tar"), maxcount=maxcount,
                                                     maxsize=3e9, verbose=0, mtime=0)
        return writers[split, source]

    try:
        for r in records:
            try:
                data = r["record"].image_bytes()
            except OSError:
                counts["images_skipped_missing"] += 1
                continue
            try:     # what the loader will decode (clipfinetune.io.read_image), checked once here
                size = checked_image_size(data, r["record"].path, r["key"])
            except ImageTooLarge:
                counts["images_skipped_too_large"] += 1
                continue
            except InputError:
                counts["images_skipped_corrupt"] += 1
                continue
            if r["size"] is not None and tuple(size) != tuple(r["size"]):
                counts["images_skipped_size_mismatch"] += 1
                continue
            split, source = split_of(r["key"], val_fraction), r["json"]["source"]
            meta = {**r["json"], "width": int(size[0]), "height": int(size[1])}
            w = writer(split, source)
            w.write({"__key__": r["key"], "jpg": data, "txt": r["txt"],
                     "json": json.dumps(meta, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()})
            name = Path(w.fname).name
            sizes[split][name] = sizes[split].get(name, 0) + 1
            counts[f"samples_{split}"] += 1
            counts[f"samples_{split}_{meta['source']}"] += 1
            for field in ("word_regions", "sentences", "local_pair", "negatives"):
                if meta[field]:
                    counts[f"samples_{split}_with_{field}"] += 1
    finally:
        for w in writers.values():
            w.close()
    for s in SPLITS:   # ShardWriter opens an empty first shard only when writing; drop empty leftovers
        for p in out_dir.glob(f"{s}-*.tar"):
            if p.name not in sizes[s]:
                p.unlink()
    return sizes


def _shard_samples(path: Path) -> Iterator[tuple[str, dict[str, tuple[int, int]], bytes | None]]:
    """(key, {member extension: (data offset, size)}, json member bytes) of each sample of one tar, in order; only
    the json members are read (the images are seeked over). Keys follow WebDataset: the member name up to the first
    dot of its base name."""
    import tarfile

    key, members, meta = None, {}, None
    with tarfile.open(path) as tf:
        for m in tf:
            if not m.isfile():
                continue
            base = m.name.rsplit("/", 1)[-1]
            if base.startswith("__") or "." not in base:
                continue                                    # WebDataset's metadata members / no extension
            stem, ext = m.name[:len(m.name) - len(base)] + base.split(".", 1)[0], base.split(".", 1)[1].lower()
            if stem != key:
                if key is not None:
                    yield key, members, meta
                key, members, meta = stem, {}, None
            if ext in members:
                raise InputError(path, key, f"two .{ext} members in one sample")
            members[ext] = (m.offset_data, m.size)
            if ext == "json":
                meta = tf.extractfile(m).read()
    if key is not None:
        yield key, members, meta


def index_shards(out_dir: str | os.PathLike) -> dict:
    """The shard index (`index.json`) of the tars in `out_dir`, read back from them as written: {split: {source:
    {"shards": [names], "samples": n, "signatures": [{"fields", "samples", "example"}], "records": {"keys": [...],
    "shard": [position in "shards"], "offset": {member: [...]}, "size": {member: [...]}}}}}. A record's members
    (jpg, json, txt) are read by offset and size (`clipfinetune.data.loader.RecordStore`), as webdataset's wids does.
    A sample without a json or jpg member, or whose json has no `source`, is an error naming the shard and key."""
    out_dir = Path(out_dir)
    index: dict[str, dict[str, dict]] = {s: {} for s in SPLITS}
    for split in SPLITS:
        signatures: dict[tuple, dict] = {}
        for path in sorted(out_dir.glob(f"{split}-*.tar")):
            for key, members, raw in _shard_samples(path):
                if raw is None or "jpg" not in members:
                    raise InputError(path, key, f"a sample needs .jpg and .json members, found {sorted(members)}")
                meta = json.loads(raw)
                if not meta.get("source"):
                    raise InputError(path, key, "the sample's json has no `source`")
                entry = index[split].setdefault(meta["source"], {
                    "shards": [], "samples": 0, "signatures": [],
                    "records": {"keys": [], "shard": [], "offset": {m: [] for m in members},
                                "size": {m: [] for m in members}}})
                table = entry["records"]
                if set(members) != set(table["offset"]):
                    raise InputError(path, key, f"members {sorted(members)} differ from the source's first sample's "
                                                f"{sorted(table['offset'])}")
                if not entry["shards"] or entry["shards"][-1] != path.name:
                    entry["shards"].append(path.name)
                entry["samples"] += 1
                table["keys"].append(key)
                table["shard"].append(len(entry["shards"]) - 1)
                for m, (offset, size) in members.items():
                    table["offset"][m].append(offset)
                    table["size"][m].append(size)
                fields = [f for f in FIELDS if meta.get(f)]
                sig = signatures.setdefault((meta["source"], tuple(fields)), {"fields": fields, "samples": 0,
                                                                              "example": meta})
                if sig["samples"] == 0:
                    entry["signatures"].append(sig)
                sig["samples"] += 1
    return index


def write_index(out_dir: str | os.PathLike) -> dict:
    """`index_shards(out_dir)` written to `out_dir/index.json` (atomically, compact: it lists every record)."""
    from clipfinetune.io import write_json

    index = index_shards(out_dir)
    write_json(Path(out_dir) / INDEX, index, indent=None)
    return index


def build_shards(out_dir: str | os.PathLike, *, prepared_dir: str | os.PathLike, sources: dict[str, dict],
                 prepared_from: dict, splits, maxcount: int, val_fraction: float, read: tuple | None = None) -> dict:
    """The `shards` stage: every record of `sources` ({name: params `sources.<name>`}) whose split is in `splits`
    (records without a split always), with the prepared annotations of its source; the whole `out_dir` (tars,
    sizes.json, index.json, meta.json) replaced atomically; returns meta. `read` = (`read_sources`' {name: records}, its
    skip Counter) when the caller has already read the sources (the stage's leakage check)."""
    from clipfinetune.data.readers import in_splits, read_sources
    from clipfinetune.io import atomic_path, write_json

    notes = Annotations(prepared_dir, prepared_from, sources)
    counts: Counter = Counter()
    if read is None:
        read = read_sources(list(sources), sources, counts), Counter()
    by_source, read_counts = read
    counts.update(read_counts)
    records, long_sources = [], set()
    for name, source_records in by_source.items():
        for record in source_records:
            if not record.captions:
                long_sources.add(name)
            if in_splits(record, splits):
                shard = shard_record(record, notes, counts)
                if shard is not None:
                    records.append(shard)
    counts["negatives_unmatched_image_dropped"] += \
        sum(len(v) for v in notes.negatives.values()) - notes.negatives_matched
    with atomic_path(out_dir, is_dir=True) as tmp:
        os.chmod(tmp, 0o755)        # mkdtemp's 0700 would make the shards private to this user
        sizes = write_shards(records, tmp, maxcount=maxcount, val_fraction=val_fraction, counts=counts)
        for key in ("images_skipped_missing", "images_skipped_corrupt", "images_skipped_too_large",
                    "images_skipped_size_mismatch",
                    "samples_train", "samples_val", "word_regions_stale_dropped", "negatives_stale_dropped",
                    "negatives_unmatched_image_dropped", "local_pair_global_wins", "local_pair_stale_dropped",
                    *(f"{name}_{what}" for name in sorted(long_sources)
                      for what in ("without_sentences", "empty_long_caption_skipped")),
                    "empty_captions_skipped"):
            counts.setdefault(key, 0)
        meta = {"maxcount": maxcount, "val_fraction": val_fraction,
                "split_rule": "val iff int(sha1(key)[:8], 16) / 2**32 < val_fraction; key = <source>_<image_id>",
                "shards": {s: len(v) for s, v in sizes.items()}, "records": len(records),
                **dict(sorted(counts.items()))}
        write_json(tmp / "sizes.json", {**sizes["train"], **sizes["val"]})
        write_json(tmp / "meta.json", meta)
        write_index(tmp)
    return meta
