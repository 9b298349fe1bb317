"""Scene records -> the benchmarks' real on-disk formats (docs/evalsets.md §1, §3.1, §4, §5, §6).

Pure functions returning JSON-ready objects; `world.py` writes them. Keys follow docs/evalsets.md:
COCO instances/captions (1.2, 1.3), Karpathy dataset_coco.json and the BLIP test list (1.6 a/b),
DOCCI jsonlines (3.1), box-classification instances (5), zero-shot ImageFolder names (6).
"""
from __future__ import annotations

import json
import re

from pycocotools import mask as mask_utils

from .scene import Scene
from .vocab import COLOUR_NAMES, SHAPE_NAMES, SHAPES

INFO = {"description": "clipfinetune embedded sample world (synthetic shapes)", "version": "1.0",
        "url": "", "contributor": "clipfinetune", "year": 2025, "date_created": ""}
LICENSES = [{"id": 0, "name": "synthetic, CC0", "url": ""}]


def shape_categories() -> list[dict]:
    return [{"id": i + 1, "name": s, "supercategory": SHAPES[s]} for i, s in enumerate(SHAPE_NAMES)]


def shape_colour_categories() -> list[dict]:
    cats, i = [], 1
    for s in SHAPE_NAMES:
        for c in COLOUR_NAMES:
            cats.append({"id": i, "name": f"{c} {s}", "supercategory": s})
            i += 1
    return cats


def coco_image(image_id: int, file_name: str, size: int) -> dict:
    return {"id": image_id, "file_name": file_name, "height": size, "width": size, "license": 0,
            "coco_url": "", "flickr_url": "", "date_captured": ""}


def object_annotation(ann_id: int, image_id: int, category_id: int, obj, size: int) -> dict:
    poly = [min(max(v, 0.0), float(size)) for v in obj.polygon]
    rle = mask_utils.merge(mask_utils.frPyObjects([poly], size, size))
    x0, y0, x1, y1 = obj.bbox
    return {"id": ann_id, "image_id": image_id, "category_id": category_id,
            "bbox": [x0, y0, round(x1 - x0, 2), round(y1 - y0, 2)], "area": float(mask_utils.area(rle)),
            "iscrowd": 0, "segmentation": [poly]}


def instances(scenes: list[Scene], coco_ids: list[int], file_names: list[str], colour_labels: bool = False) -> dict:
    cats = shape_colour_categories() if colour_labels else shape_categories()
    cat_id = {c["name"]: c["id"] for c in cats}
    images, anns = [], []
    for sc, iid, fn in zip(scenes, coco_ids, file_names):
        images.append(coco_image(iid, fn, sc.size))
        for o in sc.objects:
            name = f"{o.colour} {o.shape}" if colour_labels else o.shape
            anns.append(object_annotation(len(anns) + 1, iid, cat_id[name], o, sc.size))
    return {"info": INFO, "licenses": LICENSES, "images": images, "annotations": anns, "categories": cats}


def captions(scenes: list[Scene], coco_ids: list[int], file_names: list[str], caps: list[list[str]]) -> dict:
    images = [coco_image(i, fn, sc.size) for sc, i, fn in zip(scenes, coco_ids, file_names)]
    anns = [{"id": iid * 10 + j, "image_id": iid, "caption": c}
            for iid, cs in zip(coco_ids, caps) for j, c in enumerate(cs)]
    return {"info": INFO, "licenses": LICENSES, "images": images, "annotations": anns}


def tokens(raw: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", raw.lower())


def karpathy(splits: list[tuple[str, str, list[int], list[str], list[list[str]]]]) -> dict:
    """splits: (karpathy split name, image folder, coco ids, file names, captions) in order."""
    images, sentid = [], 0
    for split, folder, ids, names, caps in splits:
        for iid, fn, cs in zip(ids, names, caps):
            imgid = len(images)
            sents = [{"raw": c, "tokens": tokens(c), "imgid": imgid, "sentid": sentid + j} for j, c in enumerate(cs)]
            images.append({"filepath": folder, "filename": fn, "imgid": imgid, "split": split, "cocoid": iid,
                           "sentids": [s["sentid"] for s in sents], "sentences": sents})
            sentid += len(cs)
    return {"images": images, "dataset": "coco"}


def karpathy_test_blip(folder: str, names: list[str], caps: list[list[str]]) -> list[dict]:
    return [{"image": f"{folder}/{fn}", "caption": list(cs)} for fn, cs in zip(names, caps)]


def jsonlines(records: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n"
