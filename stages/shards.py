"""Stage `shards`: the records of `shards.sources` + every prepared annotation -> WebDataset tars
data/shards/{train,val}-<source>-%06d.tar (each source its own shards).

Also writes data/shards/sizes.json (open_clip's {shard: count}), data/shards/index.json (per split and source: its
shards, field signatures, from which the loader picks a method's sources, and every record's shard and member byte
offsets, from which the loader reads any record by offset) and data/shards/meta.json (counts, skips, the split rule).
The whole directory, index included, is replaced atomically. Refuses to write anything when a training image is in
a configured evaluation set (`clipfinetune.leakage`; content digests cached in data/cache/leakage).
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import source_specs, start

from clipfinetune import leakage
from clipfinetune.data.prepare.shards import build_shards
from clipfinetune.data.readers import read_sources
from clipfinetune.digests import DIGEST_CACHE

OUT = Path("data/shards")
PREPARED = Path("data/prepared")


def main() -> None:
    _, params, log = start(__doc__, "shards")
    sources = source_specs(params, params["shards.sources"])
    read_counts: Counter = Counter()
    records = read_sources(list(sources), sources, read_counts)      # read once: the leakage check and the shards
    train = leakage.training_images(sources, params["shards.splits"], records=records)
    unreadable: dict = {}
    overlaps, cost = leakage.find_overlaps(train, leakage.evaluation_sets(params["eval.evalsets"], unreadable),
                                           DIGEST_CACHE)
    log.info("leakage check: %s; not compared (unreadable): %s", cost, unreadable or "none")
    leakage.refuse(overlaps)
    prepared_from = {"word_regions": params["word_regions.sources"], "negatives": params["negatives.sources"],
                     "local_pairs": params["lism.sources"], "sentences": params["sentences.sources"]}
    meta = build_shards(OUT, prepared_dir=PREPARED, sources=sources, prepared_from=prepared_from,
                        splits=params["shards.splits"], maxcount=params["shards.maxcount"],
                        val_fraction=params["shards.val_fraction"], read=(records, read_counts))
    log.info("%d train / %d val samples in %d / %d shards (skipped: %d missing, %d corrupt images)",
             meta["samples_train"], meta["samples_val"], meta["shards"]["train"], meta["shards"]["val"],
             meta["images_skipped_missing"], meta["images_skipped_corrupt"])
    params.check_all_read()


if __name__ == "__main__":
    main()
