"""Stage `segments` (GOAL/LISM step 1): the images of `segments.source` (every split) -> segment boxes (SAM, or
the CPU segmenter).

The images (by id) are cut into work units of UNIT_IMAGES; under torchrun each rank segments
its units (round-robin) on its own device (`compute.device`) and writes one part file per unit under
data/cache/segments/<fingerprint>/; rank 0 merges them in image order, so a sharded run writes exactly what a
single run writes, and a killed run resumes from its parts (stages/_items.py, clipfinetune/parts.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages import _items
from stages._common import ITEMS, source_specs, start_preparing

import numpy as np
import pandas as pd

from clipfinetune.data.prepare.segments import build_sam, felzenszwalb_masks, sam_masks_fn, segment_image
from clipfinetune.data.readers import read_source
from clipfinetune.io import InputError, write_json, write_parquet
from clipfinetune.parts import work_units

OUT = Path("data/prepared/segments.parquet")


# images per part file, by device type: a killed run loses at most one unit per rank
UNIT_IMAGES = {"cpu": 4, "cuda": 16}
COLUMNS = ["image_id", "segment_id", "x0", "y0", "x1", "y1", "area_frac"]


def main() -> None:
    name, params, log = start_preparing(__doc__, "segments", ITEMS)
    dist = _items.setup_device(params)
    items = sorted(((r.image_id, r) for r in read_source(name, source_specs(params, name)[name])), key=lambda t: t[0])
    checkpoint = params["segments.sam_checkpoint"]
    min_area, max_area = params["segments.min_area"], params["segments.max_area"]
    sam_settings = {k: params[f"segments.{k}"] for k in
                    ("points_per_side", "pred_iou_thresh", "stability_score_thresh")}
    sam_type = params["segments.sam_type"]
    if checkpoint:
        device = str(dist.device)
        segmenter = f"segment-anything {sam_type} ({checkpoint})"
        masks_fn = sam_masks_fn(build_sam(sam_type, checkpoint, device), **sam_settings)
    else:
        device = "cpu"            # no model: scikit-image runs on the CPU
        segmenter = "scikit-image felzenszwalb (CPU alternative: no segments.sam_checkpoint set)"
        masks_fn = felzenszwalb_masks
        log.warning("no SAM checkpoint configured: using the CPU segmenter, %s", segmenter)

    def segment_unit(unit) -> dict:
        rows, skipped = [], []
        for image_id, record in unit:
            try:
                image = np.asarray(record.read_image())
            except InputError as e:
                skipped.append({"image_id": image_id, "file": str(record.path), "reason": str(e)})
                log.warning("skipping unreadable image %s (%s): %s", record.path, image_id, e)
                continue
            for k, seg in enumerate(segment_image(image, masks_fn, min_area, max_area)):
                rows.append([image_id, k, *seg.box, seg.area_frac])
        return {"rows": rows, "skipped": skipped}

    settings = {"source": name, "sam_checkpoint": checkpoint, "sam_type": sam_type, **sam_settings,
                "min_area": min_area, "max_area": max_area}
    device_type = dist.device.type if checkpoint else "cpu"
    unit_images = UNIT_IMAGES[device_type]
    store = _items.part_store(params, {**settings, "unit_images": unit_images}, device_type)
    units = work_units(items, unit_images)
    results = _items.run_sharded(store, units, lambda item: item[0], segment_unit, dist, log, "segments")
    params.check_all_read()
    if results is None:               # not rank 0: its parts are written
        _items.finish(dist)
        return
    rows = [row for r in results for row in r["rows"]]
    skipped = [s for r in results for s in r["skipped"]]
    part = pd.DataFrame(rows, columns=COLUMNS)
    part = part.sort_values(["image_id", "segment_id"], kind="stable").reset_index(drop=True)
    write_parquet(OUT, part)
    write_json(OUT.with_name("segments.meta.json"), {
        "segmenter": segmenter, "device": device, "n_images": len(items), "n_segments": len(part),
        **({"precision": "fp32"} if checkpoint else {}),          # SAM without autocast; scikit-image: no model
        "images_without_segments": len(items) - len(skipped) - part["image_id"].nunique(),
        "skipped": skipped, "min_area": min_area, "max_area": max_area})
    store.clear()
    log.info("%d segments over %d images (%s, %s)", len(part), len(items), segmenter, device)
    _items.finish(dist)


if __name__ == "__main__":
    main()
