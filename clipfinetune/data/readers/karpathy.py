"""Karpathy split reader (`dataset_coco.json` / `dataset_flickr30k.json`): images[] with split (`splits` selects;
default all), filepath (absent for Flickr30k), filename, imgid, sentences[].raw. The captions are the raw sentences,
in file order."""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.io import InputError, decode_utf8

KEYS = ("file", "images", "splits")
PATHS = ("file", "images")


def read(file, images=None, splits=None, source: str = "karpathy", counts=None):
    from clipfinetune.data.readers import Record

    path = Path(file)
    try:
        data = json.loads(decode_utf8(path.read_bytes(), path))
    except OSError as e:
        raise InputError(path, None, f"unreadable Karpathy file: {e}") from e
    except json.JSONDecodeError as e:
        raise InputError(path, None, f"not valid JSON: {e}") from e
    splits = [splits] if isinstance(splits, str) else splits
    out = []
    for rec in data["images"]:
        if splits is not None and rec.get("split") not in splits:
            continue
        out.append(Record(source=source, image_id=str(rec.get("imgid", rec.get("cocoid", len(out)))),
                          image=str(Path(rec.get("filepath", "")) / rec["filename"]),
                          images_root=Path(images) if images else None, split=str(rec.get("split", "")),
                          captions=tuple(s["raw"] for s in rec["sentences"]), origin=str(path)))
    if not out:
        raise InputError(path, None, f"no images with split in {splits}")
    return out
