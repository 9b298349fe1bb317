"""Stage `shards`: images + every prepared annotation -> WebDataset tars data/shards/{train,val}-%06d.tar.

Also writes data/shards/sizes.json (open_clip's {shard: count}) and data/shards/meta.json (counts, skips,
the split rule). The whole directory is replaced atomically. Refuses to write anything when a training image is in
a configured evaluation set (`clipfinetune.leakage`; content digests cached in data/cache/leakage).
"""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import setup_logging, stage_params, stage_parser

from clipfinetune import leakage
from clipfinetune.data.shards import build_shards

OUT = Path("data/shards")
PREPARED = Path("data/prepared")
LEAKAGE_CACHE = Path("data/cache/leakage")


def main() -> None:
    args = stage_parser(__doc__).parse_args()
    params = stage_params(args.stage or "shards")
    log = setup_logging("shards")
    train = leakage.coco_training_images(params["shards.coco_captions"], params["shards.coco_images"]) + \
        leakage.docci_training_images(params["shards.docci"], params["shards.docci_images"])
    unreadable: dict = {}
    overlaps, cost = leakage.find_overlaps(train, leakage.evaluation_sets(params["eval.benchmarks"], unreadable),
                                           LEAKAGE_CACHE)
    log.info("leakage check: %s; not compared (unreadable): %s", cost, unreadable or "none")
    leakage.refuse(overlaps)
    meta = build_shards(OUT, prepared_dir=PREPARED, coco_captions=params["shards.coco_captions"],
                        coco_images=params["shards.coco_images"], docci=params["shards.docci"],
                        docci_images=params["shards.docci_images"], maxcount=params["shards.maxcount"],
                        val_fraction=params["shards.val_fraction"])
    log.info("%d train / %d val samples in %d / %d shards (skipped: %d missing, %d corrupt images)",
             meta["samples_train"], meta["samples_val"], meta["shards"]["train"], meta["shards"]["val"],
             meta["images_skipped_missing"], meta["images_skipped_corrupt"])
    params.check_all_read()


if __name__ == "__main__":
    main()
