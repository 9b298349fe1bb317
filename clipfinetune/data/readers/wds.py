"""WebDataset reader: image-text tar shards (img2dataset's output: <key>.jpg|png|webp + <key>.txt [+ .json]).

`shards` is a path or brace pattern ("dir/{00000..00009}.tar"), expanded by webdataset. Each sample becomes one
record with the image bytes in memory (`Record.data`: meant for the subsets a fine-tuning run uses) and the `txt`
caption; image_id = the sample's `__key__`. A sample without an image or a caption is skipped and counted.
"""
from __future__ import annotations

from collections import Counter

from clipfinetune.io import InputError, decode_utf8

KEYS = ("shards", "splits")
PATHS = ()          # a brace pattern names many files: dvc.yaml declares the shards' folder by hand
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


def read(shards, splits=None, source: str = "wds", counts: Counter | None = None):
    import webdataset as wds

    from clipfinetune.data.readers import Record

    counts = Counter() if counts is None else counts
    out = []
    for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        key, url = sample["__key__"], sample.get("__url__", str(shards))
        ext = next((e for e in IMAGE_EXTENSIONS if e in sample), None)
        text = " ".join(decode_utf8(sample["txt"], url, key).split()) if "txt" in sample else ""
        if ext is None or not text:
            counts["samples_without_image_or_caption_skipped"] += 1
            continue
        out.append(Record(source=source, image_id=key, image=f"{key}.{ext}", captions=(text,),
                          data=bytes(sample[ext]), origin=url))
    if not out:
        raise InputError(shards, None, "no image-text samples")
    return out
