"""COCO readers: instances and captions JSON (2017 format), and a caption Dataset for `pretrain`.

Decisions the formats leave open, fixed here for every consumer:
- `caption_index` is the position of a caption among its image's captions **in file order** (pycocotools'
  `imgToAnns` order), empty captions skipped; caption text is whitespace-normalised (`" ".join(c.split())`).
  word_regions and shards use `captions_by_image()`; the negatives stage follows the same rule, so the
  indices agree (the shards stage re-checks the caption text of every row it attaches).
- An image's pixel size comes from the `images[]` entry (width, height); the shards and boxes trust it.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import defaultdict
from pathlib import Path

from clipfinetune.io import InputError, decode_utf8, read_image


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


def captions_by_image(coco_captions: dict, path="<captions>", counts=None) -> dict[int, list[tuple[int, str]]]:
    """image id -> [(caption_id, caption), ...] in file order (this order defines caption_index).

    Images are sorted by id; empty captions are left out (they have no caption_index) and counted in
    `counts["empty_captions_skipped"]` when a Counter is given."""
    out: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for ann in coco_captions.get("annotations", []):
        _require(path, ann, ("id", "image_id", "caption"), "caption annotation")
        text = normalize_caption(ann["caption"])
        if text:
            out[ann["image_id"]].append((ann["id"], text))
        elif counts is not None:
            counts["empty_captions_skipped"] += 1
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


def caption_pairs(captions_json: str | os.PathLike, images_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """(image path, caption) pairs of a COCO captions (or instances+captions) file, in a stable order."""
    coco = load_json(captions_json)
    imgs = images_by_id(coco, captions_json)
    pairs = []
    for image_id, caps in captions_by_image(coco, captions_json).items():
        if image_id not in imgs:
            raise InputError(captions_json, image_id, "caption refers to an image absent from images[]")
        for _, cap in caps:
            pairs.append((Path(images_dir) / imgs[image_id]["file_name"], cap))
    return pairs


class CocoCaptionDataset:
    """torch-style map Dataset of (image tensor, token tensor), one item per caption.

    `transform(PIL RGB) -> Tensor`, `tokenize([str]) -> LongTensor[1, L]`. An unreadable image raises
    `InputError` naming the file (the pretrain stage reads the sample world, which must be intact).
    """

    def __init__(self, captions_json, images_dir, transform, tokenize):
        self.pairs = caption_pairs(captions_json, images_dir)
        self.transform, self.tokenize = transform, tokenize

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int):
        path, caption = self.pairs[i]
        image = read_image(path, record=i)
        return self.transform(image), self.tokenize([caption])[0]


def coco_caption_dataset(captions_json, images_dir, transform, tokenize) -> CocoCaptionDataset:
    """The `pretrain` stage's reader: every (image, caption) pair of a COCO captions file."""
    return CocoCaptionDataset(captions_json, images_dir, transform, tokenize)
