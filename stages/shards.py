"""Stage `shards`: images + every prepared annotation -> WebDataset tars data/shards/{train,val}-%06d.tar.

Also writes data/shards/sizes.json (open_clip's {shard: count}) and data/shards/meta.json (counts, skips,
the split rule). The whole directory is replaced atomically.
"""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import setup_logging, stage_params, stage_parser

from clipfinetune.data.prepare.shards import build_shards

OUT = Path("data/shards")
PREPARED = Path("data/prepared")


def main() -> None:
    args = stage_parser(__doc__).parse_args()
    params = stage_params(args.stage or "shards")
    log = setup_logging("shards")
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
