"""ShareGPT4V-style JSON reader: a list of {id, image, conversations: [{"from": "gpt", "value": <long caption>}]}.

The long caption is the first `gpt` turn. Long-CLIP holds out the first 1,000 records as its test set
(`skip_first: 1000` for training)."""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.io import InputError

KEYS = ("file", "images", "skip_first", "splits")
PATHS = ("file", "images")


def read(file, images=None, skip_first: int = 0, splits=None, source: str = "sharegpt4v", counts=None):
    from clipfinetune.data.readers import Record

    path = Path(file)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(path, None, f"unreadable ShareGPT4V file: {e}") from e
    out = []
    for n, rec in enumerate(data[skip_first:], skip_first):
        gpt = [c.get("value", "") for c in rec.get("conversations", []) if c.get("from") == "gpt"]
        if "image" not in rec or not gpt:
            raise InputError(path, rec.get("id", n), "record lacks `image` or a gpt turn")
        out.append(Record(source=source, image_id=str(rec.get("id", n)), image=str(rec["image"]),
                          images_root=Path(images) if images else None, split="train", long_caption=gpt[0],
                          origin=str(path)))
    return out
