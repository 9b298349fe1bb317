"""COCO reader: instances and captions JSON (2017 format).

Decisions the formats leave open, fixed here for every consumer:
- `caption_index` is the position of a caption among its image's captions **in file order** (pycocotools'
  `imgToAnns` order), empty captions skipped and counted; caption text is whitespace-normalised
  (`" ".join(c.split())`). `caption_rows()` is that rule; word_regions, negatives, shards and pretrain all read
  captions through it, so their indices agree (the shards stage re-checks the caption text of every row it attaches).
- An annotation without `id`, `image_id` or `caption` is an error naming the file and the annotation.
- An image's pixel size comes from the `images[]` entry (width, height); the shards and boxes trust it.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from collections import defaultdict
from pathlib import Path

from clipfinetune.io import InputError, decode_utf8

# COCO's image file names: train2017/000000000042.jpg, val2014/COCO_val2014_000000000042.jpg
COCO_NAME = re.compile(r"^(?:COCO_[a-z]+\d{4}_)?(\d{12})\.(?:jpg|jpeg|png)$", re.IGNORECASE)


def coco_id_of(path: str | os.PathLike) -> int | None:
    """The COCO image id in a COCO-named file, else None."""
    m = COCO_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


@contextlib.contextmanager
def gc_paused():
    """Millions of small dicts, lists and tuples are made while reading COCO, none in cycles; the cyclic GC would
    re-scan the whole growing heap again and again (~40% of the JSON, index and box CPU at COCO scale)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def load_json(path: str | os.PathLike) -> dict:
    """A COCO JSON file, parsed by orjson when installed (a dvc dependency; ~3x less CPU on COCO's 190 MB).
    Whatever orjson rejects (non-UTF-8, NaN, lone surrogates, a missing file, ...) is re-read by
    `load_json_stdlib`, so the errors name the file as always. orjson reads integers beyond 64 bits as floats;
    no COCO field holds one."""
    try:
        import orjson

        with open(path, "rb") as f, gc_paused():
            return orjson.loads(f.read())
    except Exception:   # noqa: BLE001  (missing module or file, any parse error: the reference reader decides)
        return load_json_stdlib(path)


def load_json_stdlib(path: str | os.PathLike) -> dict:
    """The reference reader (`json`): an InputError naming the file for a missing file, bad UTF-8 or bad JSON."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, None, "file not found")
    text = decode_utf8(path.read_bytes(), path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(path, None, f"not valid JSON: {e}") from e


def _require(path, obj: dict, keys: tuple[str, ...], where: str):
    missing = [k for k in keys if k not in obj]
    if missing:
        raise InputError(path, obj.get("id", where), f"{where} lacks keys {missing}")


def images_by_id(coco: dict, path="<coco>") -> dict[int, dict]:
    """image id -> {"id", "file_name", "width", "height"} from a COCO instances or captions file."""
    out = {}
    for img in coco.get("images", []):
        _require(path, img, ("id", "file_name", "width", "height"), "image")
        if img["id"] in out:
            raise InputError(path, img["id"], "duplicate image id in images[]")
        out[img["id"]] = img
    return out


def normalize_caption(text) -> str:
    return " ".join(str(text).split())


def caption_rows(coco_captions: dict, path="<captions>", counts=None):
    """(image_id, caption_index, caption_id, caption) in file order; empty captions are left out (they have no
    caption_index) and counted in `counts["empty_captions_skipped"]` when a Counter is given."""
    per_image: dict = defaultdict(int)
    for ann in coco_captions.get("annotations", []):
        _require(path, ann, ("id", "image_id", "caption"), "caption annotation")
        text = normalize_caption(ann["caption"]) if isinstance(ann["caption"], str) else ""
        if not text:
            if counts is not None:
                counts["empty_captions_skipped"] += 1
            continue
        image_id = ann["image_id"]
        yield image_id, per_image[image_id], ann["id"], text
        per_image[image_id] += 1


def captions_by_image(coco_captions: dict, path="<captions>", counts=None) -> dict[int, list[tuple[int, str]]]:
    """image id -> [(caption_id, caption), ...] in caption_index order (`caption_rows`), images sorted by id."""
    out: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for image_id, _, caption_id, text in caption_rows(coco_captions, path, counts):
        out[image_id].append((caption_id, text))
    return dict(sorted(out.items()))


def instances_by_image(coco_instances: dict, path="<instances>") -> dict[int, list[dict]]:
    """image id -> instance annotations (sorted by annotation id)."""
    out: dict[int, list[dict]] = defaultdict(list)
    for ann in coco_instances.get("annotations", []):
        _require(path, ann, ("id", "image_id", "category_id", "bbox"), "instance annotation")
        out[ann["image_id"]].append(ann)
    return {k: sorted(v, key=lambda a: a["id"]) for k, v in sorted(out.items())}


def categories(coco_instances: dict, path="<instances>") -> dict[int, str]:
    cats = {}
    for c in coco_instances.get("categories", []):
        _require(path, c, ("id", "name"), "category")
        cats[c["id"]] = str(c["name"])
    if not cats:
        raise InputError(path, "categories", "no categories (is this an instances file?)")
    return cats


KEYS = ("captions", "images", "instances", "splits")
IMAGE_KEYS = ("id", "file_name", "width", "height")   # images[] keys a Record holds as fields
PATHS = ("captions", "images", "instances")


def read(captions, images, instances=None, splits=None, source: str = "coco", counts=None):
    """A COCO captions file -> one `Record` per image with captions (images sorted by id). `instances` is the
    source's instances file (read by `word_regions`, not here); COCO files carry no split (`splits` is ignored)."""
    from clipfinetune.data.readers import Record

    coco = load_json(captions)
    imgs = images_by_id(coco, captions)
    out = []
    for image_id, caps in captions_by_image(coco, captions, counts).items():
        if image_id not in imgs:
            raise InputError(captions, image_id, "captions of an image absent from images[]")
        img = imgs[image_id]
        out.append(Record(source=source, image_id=str(image_id), image=img["file_name"], images_root=Path(images),
                          captions=tuple(c for _, c in caps), size=(int(img["width"]), int(img["height"])),
                          origin=str(captions), extra={k: v for k, v in img.items() if k not in IMAGE_KEYS}))
    return out
