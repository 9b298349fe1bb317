"""Karpathy's COCO split as a COCO-format training corpus: the leak-free train set for models scored on the
Karpathy 5K test (which is drawn from val2014, so train2017 contains ~4.4K of its images).

    python -m clipfinetune.data.karpathy --karpathy datasets/karpathy/dataset_coco.json --splits train restval \
        --instances datasets/coco/annotations/instances_train2014.json datasets/coco/annotations/instances_val2014.json \
        --exclude datasets/coco/annotations/instances_val2017.json \
        --out datasets/coco/annotations/karpathy_train_restval

writes `<out>/captions.json` and `<out>/instances.json` (COCO format) over the images of the chosen splits, minus
every image id of the `--exclude` COCO files (val2017 is drawn from val2014 as well: ~3.8K of its images are in
restval, so a recipe that also scores val2017 benchmarks excludes them). `file_name` = Karpathy's
`<filepath>/<filename>` (e.g. `val2014/COCO_val2014_000000000042.jpg`), relative to the COCO root (`shards.coco_images:
datasets/coco`). Captions are Karpathy's `raw` sentences (caption id = `sentid`); instances are the annotations of
the kept images found in the `--instances` files (2014 or 2017: COCO keeps ids across releases).

A small reader kept outside the pipeline on purpose: #23 moves training corpora to `sources:` readers, where this
becomes `{reader: karpathy, karpathy: ..., instances: [...], splits: [train, restval], exclude: [...]}`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from clipfinetune.data import coco as cocoio
from clipfinetune.io import InputError, write_json

KARPATHY_SPLITS = ("train", "restval", "val", "test")


def karpathy_to_coco(karpathy_json, splits=("train", "restval"), instances=(), exclude=()) -> tuple[dict, dict, dict]:
    """(captions, instances, counts) COCO dicts for the Karpathy images of `splits` not in any `exclude` file."""
    if not instances:
        raise ValueError("the COCO instances files are needed: the shards take each image's width/height from them")
    unknown = set(splits) - set(KARPATHY_SPLITS)
    if unknown:
        raise ValueError(f"unknown Karpathy splits {sorted(unknown)} (known: {KARPATHY_SPLITS})")
    data = cocoio.load_json(karpathy_json)
    excluded = {int(im["id"]) for f in exclude for im in cocoio.load_json(f).get("images", [])}
    images, captions, counts = {}, [], {"excluded": 0}
    for rec in data.get("images", []):
        if rec.get("split") not in splits:
            continue
        if "cocoid" not in rec:
            raise InputError(karpathy_json, rec.get("imgid"), "no `cocoid` (is this the COCO split file?)")
        cocoid = int(rec["cocoid"])
        if cocoid in excluded:
            counts["excluded"] += 1
            continue
        images[cocoid] = {"id": cocoid, "file_name": f"{rec.get('filepath', '')}/{rec['filename']}".lstrip("/")}
        captions += [{"id": int(s["sentid"]), "image_id": cocoid, "caption": s["raw"]} for s in rec["sentences"]]
    categories, annotations, sizes = None, [], {}
    for f in instances:
        inst = cocoio.load_json(f)
        categories = categories or inst.get("categories", [])
        for im in inst.get("images", []):
            if int(im["id"]) in images:
                sizes[int(im["id"])] = (int(im["width"]), int(im["height"]))
        annotations += [a for a in inst.get("annotations", []) if int(a["image_id"]) in images]
    for cocoid, im in images.items():      # the shards trust width/height (data/coco.py): from the instances files
        if cocoid not in sizes:
            raise InputError(instances[0], cocoid, "Karpathy image absent from every --instances file")
        im["width"], im["height"] = sizes[cocoid]
    info = {"description": f"Karpathy {'+'.join(splits)} of {Path(karpathy_json).name}"
                           + (f" minus the images of {', '.join(Path(f).name for f in exclude)}" if exclude else "")}
    ims = sorted(images.values(), key=lambda im: im["id"])
    counts.update(images=len(ims), captions=len(captions), annotations=len(annotations))
    return ({"info": info, "images": ims, "annotations": captions},
            {"info": info, "images": ims, "annotations": annotations, "categories": categories or []}, counts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clipfinetune.data.karpathy", description=__doc__.splitlines()[0])
    p.add_argument("--karpathy", required=True, help="Karpathy dataset_coco.json")
    p.add_argument("--splits", nargs="+", default=["train", "restval"])
    p.add_argument("--instances", nargs="+", required=True, help="COCO instances files covering those images")
    p.add_argument("--exclude", nargs="*", default=[], help="COCO files whose image ids are left out")
    p.add_argument("--out", required=True, help="folder for captions.json and instances.json")
    args = p.parse_args(argv)
    captions, instances, counts = karpathy_to_coco(args.karpathy, args.splits, args.instances, args.exclude)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "captions.json", captions, indent=None)
    write_json(out / "instances.json", instances, indent=None)
    print(f"{out}: {counts['images']} images, {counts['captions']} captions, {counts['annotations']} instances "
          f"({counts['excluded']} images excluded)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
