"""Karpathy split reader (`dataset_coco.json` / `dataset_flickr30k.json`): images[] with split (`splits` selects;
default all), filepath (absent for Flickr30k), filename, imgid, cocoid (COCO's file only), sentences[].raw. The
captions are the raw sentences, in file order.

`image_id` is the COCO image id (`cocoid`) when the file carries one, so a Karpathy COCO record and the coco
reader's record of the same picture share an id (Karpathy's own `imgid` is a position in its file, no COCO id);
Flickr30k's file has no cocoid: `imgid`. `exclude` lists COCO files (instances or captions, read by the coco reader)
whose image ids are left out, counted as `karpathy_excluded` (e.g. val2017's images, which restval holds), or
VALSE piece files ({key: {"image_file": "COCO_val2014_<id>.jpg", ...}}: FOIL-it's val2014 images), by the COCO id
in their file names.
"""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.io import InputError, decode_utf8

KEYS = ("file", "images", "splits", "exclude")
PATHS = ("file", "images")


def excluded_ids(files) -> set[str]:
    """The image ids of COCO files (`images[].id`) and of VALSE pieces (COCO-named `image_file`s), as strings."""
    from clipfinetune.data.readers import coco
    from clipfinetune.data.readers.coco import coco_id_of

    out = set()
    for f in [files] if isinstance(files, str) else files or []:
        data = coco.load_json(f)
        if "images" in data:
            out |= {str(i) for i in coco.images_by_id(data, f)}
        else:
            ids = {coco_id_of(s.get("image_file", "")) for s in data.values() if isinstance(s, dict)}
            out |= {str(i) for i in ids if i is not None}
    return out


def read(file, images=None, splits=None, exclude=None, source: str = "karpathy", counts=None):
    from clipfinetune.data.readers import Record

    path = Path(file)
    try:
        data = json.loads(decode_utf8(path.read_bytes(), path))
    except OSError as e:
        raise InputError(path, None, f"unreadable Karpathy file: {e}") from e
    except json.JSONDecodeError as e:
        raise InputError(path, None, f"not valid JSON: {e}") from e
    splits = [splits] if isinstance(splits, str) else splits
    skip = excluded_ids(exclude)
    out = []
    for rec in data["images"]:
        if splits is not None and rec.get("split") not in splits:
            continue
        image_id = str(rec["cocoid"] if "cocoid" in rec else rec.get("imgid", len(out)))
        if image_id in skip:
            if counts is not None:
                counts["karpathy_excluded"] += 1
            continue
        out.append(Record(source=source, image_id=image_id,
                          image=str(Path(rec.get("filepath", "")) / rec["filename"]),
                          images_root=Path(images) if images else None, split=str(rec.get("split", "")),
                          captions=tuple(s["raw"] for s in rec["sentences"]), origin=str(path)))
    if not out:
        raise InputError(path, None, f"no images with split in {splits}")
    return out
