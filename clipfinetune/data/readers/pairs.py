"""Image-text pairs reader: a CSV or Parquet table (the form of LAION-COCO and CC3M subsets, as img2dataset or
open_clip's `CsvDataset` keep them) with one row per (image, caption).

Columns: `image` (a path relative to `images`) and `caption`, or the names given by `image_column` /
`caption_column` (open_clip's CSV: `filepath` / `title`). Rows of one image are grouped into one record, captions in
row order; image_id = the image path as written. An empty caption is skipped and counted; a missing column or a row
without an image is an error naming the table and the row.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from clipfinetune.io import InputError

KEYS = ("table", "images", "image_column", "caption_column", "splits")
PATHS = ("table", "images")


def read_table(path: Path):
    import pandas as pd

    if not path.is_file():
        raise InputError(path, None, "file not found")
    try:
        if path.suffix == ".parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path, sep="\t" if path.suffix in (".tsv", ".tab") else ",", dtype=str,
                           keep_default_na=False)
    except Exception as e:
        raise InputError(path, None, f"unreadable table: {e}") from e


def read(table, images=None, image_column: str = "image", caption_column: str = "caption", splits=None,
         source: str = "pairs", counts: Counter | None = None):
    from clipfinetune.data.readers import Record

    path = Path(table)
    frame = read_table(path)
    missing = [c for c in (image_column, caption_column) if c not in frame.columns]
    if missing:
        raise InputError(path, None, f"no column {missing} (columns: {list(frame.columns)})")
    captions: dict[str, list[str]] = {}
    for n, (image, caption) in enumerate(zip(frame[image_column], frame[caption_column])):
        image = "" if image is None else str(image).strip()
        if not image:
            raise InputError(path, f"row {n}", f"empty `{image_column}`")
        text = " ".join(str(caption or "").split())
        if not text:
            if counts is not None:
                counts["empty_captions_skipped"] += 1
            continue
        captions.setdefault(image, []).append(text)
    return [Record(source=source, image_id=image, image=image, images_root=Path(images) if images else None,
                   captions=tuple(texts), origin=str(path)) for image, texts in captions.items()]
