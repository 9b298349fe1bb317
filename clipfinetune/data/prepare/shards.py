"""WebDataset shards: one sample per training image, carrying every annotation the methods need.

A sample (DEVELOPERS.md "A shard sample"): `__key__` = `<source>_<image_id>` (dots replaced by `-`:
WebDataset splits keys at the first dot), `jpg` = the original file bytes (never re-encoded), `json` =
all annotations (sorted keys, compact, UTF-8), `txt` = one caption so `open_clip_train` reads the shards
as they are. Decisions:
- `txt`: COCO -> the first caption (caption_index 0); DOCCI -> the summary sentence (sentence 0; the
  whole long caption when it has no sentences row). DOCCI records have `captions: []` (DOCCI has no
  short captions; the summary is `sentences[0]`).
- Sample order: by SHA-1 of the key, so every shard mixes COCO and DOCCI samples (a method that wants
  one source still finds samples in every shard / loader worker). Split: a sample is `val` iff the first
  8 hex digits of SHA-1(key) / 2^32 < `val_fraction` (fixed per image, independent of the rest).
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
from pathlib import Path

import pandas as pd

from clipfinetune.data.readers import coco as cocoio
from clipfinetune.io import ImageTooLarge, InputError, checked_image_size

SPLITS = ("train", "val")
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


def coco_records(captions_json, images_dir, word_regions: pd.DataFrame, negatives: pd.DataFrame,
                 counts: Counter) -> list[dict]:
    coco = cocoio.load_json(captions_json)
    imgs = cocoio.images_by_id(coco, captions_json)
    wr, neg = _group(word_regions), _group(negatives)
    out = []
    for image_id, caps in cocoio.captions_by_image(coco, captions_json, counts).items():
        if image_id not in imgs:
            raise InputError(captions_json, image_id, "captions of an image absent from images[]")
        img, captions = imgs[image_id], [c for _, c in caps]
        regions = []
        for r in sorted(wr.get(str(image_id), []), key=lambda r: (r.caption_index, r.char_start)):
            k = int(r.caption_index)
            if not (0 <= k < len(captions)) or captions[k] != r.caption or captions[k][r.char_start:r.char_end] != r.word:
                counts["word_regions_stale_dropped"] += 1
                continue
            regions.append({"caption_index": k, "word": r.word, "char_span": [int(r.char_start), int(r.char_end)],
                            "box": _box(r), "category": r.category})
        out.append({"key": sample_key("coco", image_id), "path": Path(images_dir) / img["file_name"],
                    "size": (int(img["width"]), int(img["height"])),
                    "json": {"image_id": str(image_id), "source": "coco", "captions": captions, "long_caption": "",
                             "word_regions": regions, "sentences": [], "local_pair": [],
                             "negatives": _negatives(neg.pop(str(image_id), []), captions, counts)},
                    "txt": captions[0]})
    counts["negatives_unmatched_image_dropped"] += sum(len(v) for v in neg.values())
    return out


def _negatives(rows, captions: list[str], counts: Counter) -> list[dict]:
    groups: dict[tuple[int, str], list[str]] = {}
    for r in rows:   # row order within (caption_index, type) is the producer's order
        k = int(r.caption_index)
        if not (0 <= k < len(captions)) or captions[k] != r.caption:
            counts["negatives_stale_dropped"] += 1
            continue
        groups.setdefault((k, str(r.type)), []).append(str(r.negative))
    return [{"caption_index": k, "type": t, "texts": texts} for (k, t), texts in sorted(groups.items())]


def docci_records(docci: list[dict], images_dir, sentences: pd.DataFrame, local_pairs: pd.DataFrame,
                  counts: Counter) -> list[dict]:
    sents = _group(sentences[sentences["source"] == "docci"])
    pairs = _group(local_pairs)
    out = []
    for ex in docci:
        image_id = ex["image_id"]
        rows = sorted(sents.get(image_id, []), key=lambda r: r.sentence_index)
        long_caption = rows[0].long_caption if rows else (ex["long_caption"] or "").strip()
        if not long_caption:
            counts["docci_empty_long_caption_skipped"] += 1
            continue
        if not rows:
            counts["docci_without_sentences"] += 1
        sentences_ = [{"text": r.text, "char_span": [int(r.char_start), int(r.char_end)]} for r in rows]
        chosen = [r for r in pairs.get(image_id, []) if bool(r.chosen)]
        if len(chosen) > 1:
            raise InputError("local_pairs.parquet", image_id, f"{len(chosen)} chosen local pairs (at most 1)")
        local = []
        for r in chosen:
            if r.kind != "region":
                counts["local_pair_global_wins"] += 1
            elif not (0 <= int(r.sentence_index) < len(sentences_)):
                counts["local_pair_stale_dropped"] += 1
            else:
                local.append({"sentence_index": int(r.sentence_index), "box": _box(r)})
        out.append({"key": sample_key("docci", image_id), "path": Path(images_dir) / ex["image"], "size": None,
                    "json": {"image_id": image_id, "source": "docci", "captions": [], "long_caption": long_caption,
                             "word_regions": [], "sentences": sentences_, "local_pair": local, "negatives": []},
                    "txt": sentences_[0]["text"] if sentences_ else long_caption})
    return out


def write_shards(records: list[dict], out_dir: str | os.PathLike, *, maxcount: int, val_fraction: float,
                 counts: Counter) -> dict:
    """Write {train,val}-%06d.tar + sizes.json into out_dir; returns {split: {shard name: count}}."""
    import webdataset as wds

    out_dir = Path(out_dir)
    records = sorted(records, key=lambda r: (key_digest(r["key"]), r["key"]))
    keys = [r["key"] for r in records]
    if len(set(keys)) != len(keys):
        dup = next(k for k, n in Counter(keys).items() if n > 1)
        raise InputError(out_dir, dup, "two samples share a key")
    sizes: dict[str, dict[str, int]] = {s: {} for s in SPLITS}
    writers = {s: wds.ShardWriter(str(out_dir / f"{s}-%06d.tar"), maxcount=maxcount, maxsize=3e9, verbose=0,
                                  mtime=0) for s in SPLITS}
    try:
        for r in records:
            try:
                data = Path(r["path"]).read_bytes()
            except OSError:
                counts["images_skipped_missing"] += 1
                continue
            try:     # what the loader will decode (clipfinetune.io.read_image), checked once here
                size = checked_image_size(data, r["path"], r["key"])
            except ImageTooLarge:
                counts["images_skipped_too_large"] += 1
                continue
            except InputError:
                counts["images_skipped_corrupt"] += 1
                continue
            if r["size"] is not None and tuple(size) != tuple(r["size"]):
                counts["images_skipped_size_mismatch"] += 1
                continue
            split = split_of(r["key"], val_fraction)
            meta = {**r["json"], "width": int(size[0]), "height": int(size[1])}
            w = writers[split]
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


def build_shards(out_dir: str | os.PathLike, *, prepared_dir: str | os.PathLike, coco_captions, coco_images,
                 docci, docci_images, maxcount: int, val_fraction: float) -> dict:
    """The `shards` stage: the whole `out_dir` (tars, sizes.json, meta.json) replaced atomically; returns meta."""
    from clipfinetune.data.prepare.sentences import read_docci
    from clipfinetune.io import atomic_path, write_json

    prepared = Path(prepared_dir)
    word_regions = read_prepared(prepared / "word_regions.parquet", "word_regions", "word_regions")
    sentences = read_prepared(prepared / "sentences.parquet", "sentences", "sentences")
    local_pairs = read_prepared(prepared / "local_pairs.parquet", "local_pairs", "lism")
    negatives = read_prepared(prepared / "negatives.parquet", "negatives", "negatives")
    counts: Counter = Counter()
    records = coco_records(coco_captions, coco_images, word_regions, negatives, counts)
    records += docci_records(read_docci(docci, splits=("train",)), docci_images, sentences, local_pairs, counts)
    with atomic_path(out_dir, is_dir=True) as tmp:
        os.chmod(tmp, 0o755)        # mkdtemp's 0700 would make the shards private to this user
        sizes = write_shards(records, tmp, maxcount=maxcount, val_fraction=val_fraction, counts=counts)
        for key in ("images_skipped_missing", "images_skipped_corrupt", "images_skipped_too_large",
                    "images_skipped_size_mismatch",
                    "samples_train", "samples_val", "word_regions_stale_dropped", "negatives_stale_dropped",
                    "negatives_unmatched_image_dropped", "local_pair_global_wins", "local_pair_stale_dropped",
                    "docci_without_sentences", "docci_empty_long_caption_skipped", "empty_captions_skipped"):
            counts.setdefault(key, 0)
        meta = {"maxcount": maxcount, "val_fraction": val_fraction,
                "split_rule": "val iff int(sha1(key)[:8], 16) / 2**32 < val_fraction; key = <source>_<image_id>",
                "shards": {s: len(v) for s, v in sizes.items()}, "records": len(records),
                **dict(sorted(counts.items()))}
        write_json(tmp / "sizes.json", {**sizes["train"], **sizes["val"]})
        write_json(tmp / "meta.json", meta)
    return meta
