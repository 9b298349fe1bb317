"""DOCCI reader: `docci_descriptions.jsonlines` (example_id, split, image_file, description).

One rule for every consumer: each line must have the four keys (a missing `split` is an error naming the file and
the example, never a default); `splits` keeps the records whose `split` is listed (DOCCI's own splits: train, test,
qual_dev, qual_test); an example_id seen twice is an error. The description is kept as written (consumers strip).
"""
from __future__ import annotations

from pathlib import Path

from clipfinetune.io import InputError, read_jsonlines

KEYS = ("descriptions", "images", "splits")
PATHS = ("descriptions", "images")
FIELDS = ("example_id", "split", "image_file", "description")


def read(descriptions, images=None, splits=None, source: str = "docci", counts=None):
    from clipfinetune.data.readers import Record

    path, out, seen = Path(descriptions), [], set()
    for n, ex in read_jsonlines(path):
        if not isinstance(ex, dict):
            raise InputError(path, f"line {n}", "not a DOCCI record (a JSON object per line)")
        missing = [k for k in FIELDS if k not in ex]
        if missing:
            raise InputError(path, ex.get("example_id", f"line {n}"), f"missing keys {missing}")
        image_id = str(ex["example_id"])
        if image_id in seen:
            raise InputError(path, image_id, f"duplicate example_id (line {n})")
        seen.add(image_id)
        if splits is None or ex["split"] in splits:
            out.append(Record(source=source, image_id=image_id, image=str(ex["image_file"]),
                              images_root=Path(images) if images else None, split=str(ex["split"]),
                              long_caption=str(ex["description"]), origin=str(path)))
    return out
