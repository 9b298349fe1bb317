"""Stage `segments` (GOAL/LISM step 1): the images of `segments.source` (every split) -> segment boxes (SAM, or
the CPU segmenter).

Under torchrun each rank segments a strided slice of the images and rank 0 merges the parts in image order,
so a sharded run writes exactly what a single run writes.
"""
from __future__ import annotations

import os
from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
import numpy as np
import pandas as pd
from _common import source_specs, start

from clipfinetune.data.prepare.segments import (
    build_sam,
    felzenszwalb_masks,
    sam_masks_fn,
    segment_image,
    shard_of,
)
from clipfinetune.data.readers import read_source
from clipfinetune.io import InputError, write_json, write_parquet

OUT = Path("data/prepared/segments.parquet")


def main() -> None:
    _, params, log = start(__doc__, "segments")
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    name = params["segments.source"]
    items = sorted(((r.image_id, r) for r in read_source(name, source_specs(params, name)[name])), key=lambda t: t[0])
    checkpoint = params["segments.sam_checkpoint"]
    min_area, max_area = params["segments.min_area"], params["segments.max_area"]
    sam_settings = {k: params[f"segments.{k}"] for k in
                    ("points_per_side", "pred_iou_thresh", "stability_score_thresh")}
    sam_type = params["segments.sam_type"]
    if checkpoint:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
        segmenter = f"segment-anything {sam_type} ({checkpoint})"
        masks_fn = sam_masks_fn(build_sam(sam_type, checkpoint, device), **sam_settings)
    else:
        segmenter = "scikit-image felzenszwalb (CPU alternative: no segments.sam_checkpoint set)"
        masks_fn = felzenszwalb_masks
        log.warning("no SAM checkpoint configured: using the CPU segmenter, %s", segmenter)

    rows, skipped = [], []
    for image_id, record in shard_of(items, rank, world_size):
        try:
            image = np.asarray(record.read_image())
        except InputError as e:
            skipped.append({"image_id": image_id, "file": str(record.path), "reason": str(e)})
            log.warning("skipping unreadable image %s (%s): %s", record.path, image_id, e)
            continue
        for k, seg in enumerate(segment_image(image, masks_fn, min_area, max_area)):
            rows.append({"image_id": image_id, "segment_id": k, "x0": seg.box[0], "y0": seg.box[1],
                         "x1": seg.box[2], "y1": seg.box[3], "area_frac": seg.area_frac})
    part = pd.DataFrame(rows, columns=["image_id", "segment_id", "x0", "y0", "x1", "y1", "area_frac"])
    if world_size > 1:
        part, skipped = _merge_ranks(part, skipped, rank, world_size)
        if rank != 0:
            return
    part = part.sort_values(["image_id", "segment_id"], kind="stable").reset_index(drop=True)
    write_parquet(OUT, part)
    write_json(OUT.with_name("segments.meta.json"), {
        "segmenter": segmenter, "n_images": len(items), "n_segments": len(part),
        "images_without_segments": len(items) - len(skipped) - part["image_id"].nunique(),
        "skipped": skipped, "min_area": min_area, "max_area": max_area})
    log.info("%d segments over %d images (%s)", len(part), len(items), segmenter)
    params.check_all_read()


def _merge_ranks(part, skipped, rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (part, skipped))
    dist.destroy_process_group()
    return pd.concat([g[0] for g in gathered]), [s for g in gathered for s in g[1]]


if __name__ == "__main__":
    main()
