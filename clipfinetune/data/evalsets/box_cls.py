"""Box (region) classification sets (docs/evalsets.md §5): COCO instances (`instances_*.json`), COCO panoptic
(`panoptic_*.json` + id PNGs) and LVIS (`lvis_v1_val.json`) -> `BoxSet` (the evaluation is `clipfinetune.eval.box_cls`).

Label = index of the category id in the sorted category ids. Boxes: thing / instance -> GT bbox; panoptic stuff ->
tight box of its mask; a box with w*h < 8**2 or > 1024**2 is skipped and counted (CLIPSelf). Crowd annotations: kept
for panoptic (CLIPSelf does), dropped for COCO instances (a crowd box covers many objects).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from clipfinetune.boxes import clip_box, xywh_to_xyxy
from clipfinetune.data.evalsets.images import resolve_image
from clipfinetune.io import InputError

MIN_AREA, MAX_AREA = 8 ** 2, 1024 ** 2
MAX_PANOPTIC_SEGMENTS = 100      # CLIPSelf/FineCLIP COCOPanopticDataset: max_anns = min(max #segments, 100)


@dataclass
class BoxSet:
    classnames: list[str]
    images: list[tuple[str, np.ndarray]] = field(default_factory=list)   # (path, boxes [n, 4] xyxy)
    labels: list[int] = field(default_factory=list)
    frequency: list[str] | None = None                                      # LVIS r/c/f per class
    skipped: dict = field(default_factory=lambda: {"small_or_huge": 0, "degenerate": 0, "crowd": 0})


def clean_name(name: str) -> str:
    return name.replace("_", " ").replace("/", " or ").lower().rstrip(".")


def _categories(data: dict):
    cats = sorted(data["categories"], key=lambda c: c["id"])
    return {c["id"]: i for i, c in enumerate(cats)}, cats


def _add(out: BoxSet, per_image: dict, path: str, box, label: int, orig_wh) -> None:
    x0, y0, x1, y1 = box
    area = (x1 - x0) * (y1 - y0)
    if area < MIN_AREA or area > MAX_AREA:
        out.skipped["small_or_huge"] += 1
        return
    clipped = clip_box(box, orig_wh)
    if clipped is None:
        out.skipped["degenerate"] += 1
        return
    per_image.setdefault(path, []).append((clipped, label))


def _finish(out: BoxSet, per_image: dict) -> BoxSet:
    for path, items in per_image.items():
        out.images.append((path, np.array([b for b, _ in items], dtype=np.float32)))
        out.labels.extend(lbl for _, lbl in items)
    return out


def read_instances(path, images_root) -> BoxSet:
    data = json.loads(Path(path).read_text())
    index, cats = _categories(data)
    imgs = {im["id"]: im for im in data["images"]}
    out, per_image = BoxSet([clean_name(c["name"]) for c in cats]), {}
    for ann in data["annotations"]:
        if ann.get("iscrowd", 0):
            out.skipped["crowd"] += 1
            continue
        im = imgs.get(ann["image_id"])
        if im is None or ann["category_id"] not in index:
            raise InputError(path, ann.get("id"), "annotation names an unknown image or category")
        p = resolve_image(im["file_name"], images_root, im["id"])
        _add(out, per_image, p, xywh_to_xyxy(ann["bbox"]), index[ann["category_id"]], (im["width"], im["height"]))
    return _finish(out, per_image)


def _rgb2id(png: np.ndarray) -> np.ndarray:
    png = png.astype(np.int64)
    return png[..., 0] + 256 * png[..., 1] + 256 * 256 * png[..., 2]


def read_panoptic(path, images_root, masks_dir=None) -> BoxSet:
    """Things: GT bbox; stuff: tight box of `segm == id` in the PNG (R + 256 G + 256² B). Crowd segments are
    kept and each image's first 100 `segments_info` entries are read, as FineCLIP's `COCOPanopticDataset`; the
    ones past 100 are counted in `skipped["over_100_segments"]`."""
    from PIL import Image

    data = json.loads(Path(path).read_text())
    masks_dir = Path(masks_dir) if masks_dir else Path(path).with_suffix("")
    index, cats = _categories(data)
    isthing = {c["id"]: c.get("isthing", 1) for c in cats}
    imgs = {im["id"]: im for im in data["images"]}
    out, per_image = BoxSet([clean_name(c["name"]) for c in cats]), {}
    for ann in data["annotations"]:
        im = imgs[ann["image_id"]]
        p = resolve_image(im["file_name"], images_root, im["id"])
        segm = None
        segments = ann["segments_info"]
        if len(segments) > MAX_PANOPTIC_SEGMENTS:
            out.skipped["over_100_segments"] = (out.skipped.get("over_100_segments", 0) + len(segments)
                                                - MAX_PANOPTIC_SEGMENTS)
        for seg in segments[:MAX_PANOPTIC_SEGMENTS]:
            if isthing[seg["category_id"]]:
                box = xywh_to_xyxy(seg["bbox"])
            else:
                if segm is None:
                    segm = _rgb2id(np.asarray(Image.open(masks_dir / ann["file_name"]).convert("RGB")))
                ys, xs = np.nonzero(segm == seg["id"])
                if len(xs) == 0:
                    out.skipped["degenerate"] += 1
                    continue
                box = [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]
            _add(out, per_image, p, box, index[seg["category_id"]], (im["width"], im["height"]))
    return _finish(out, per_image)


def read_lvis(path, images_root) -> BoxSet:
    """LVIS v1: image folder from `coco_url` (train2017/ or val2017/), categories 1..1203 with r/c/f."""
    data = json.loads(Path(path).read_text())
    index, cats = _categories(data)
    imgs = {im["id"]: im for im in data["images"]}
    out, per_image = BoxSet([clean_name(c["name"]) for c in cats]), {}
    out.frequency = [c.get("frequency", "?") for c in cats]
    for ann in data["annotations"]:
        im = imgs[ann["image_id"]]
        name = "/".join(im["coco_url"].split("/")[-2:]) if im.get("coco_url") else im["file_name"]
        p = resolve_image(name, images_root, im["id"])
        _add(out, per_image, p, xywh_to_xyxy(ann["bbox"]), index[ann["category_id"]], (im["width"], im["height"]))
    return _finish(out, per_image)


def load_box_set(cfg: dict) -> BoxSet:
    """`eval.evalsets.box_cls.<set>`: `instances` | `panoptic` (+ `panoptic_masks`) | `lvis`, + `images`."""
    if cfg.get("instances"):
        return read_instances(cfg["instances"], cfg.get("images"))
    if cfg.get("panoptic"):
        return read_panoptic(cfg["panoptic"], cfg.get("images"), cfg.get("panoptic_masks"))
    if cfg.get("lvis"):
        return read_lvis(cfg["lvis"], cfg.get("images"))
    raise ValueError(f"box_cls benchmark needs one of instances|panoptic|lvis, got {sorted(cfg)}")
