"""Stage `word_regions` (HarmoCLIP): COCO instances + captions -> data/prepared/word_regions.parquet + meta."""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import setup_logging, stage_params, stage_parser

from clipfinetune.data.coco import load_json
from clipfinetune.data.word_regions import build_word_regions
from clipfinetune.io import write_json, write_parquet

OUT = Path("data/prepared/word_regions.parquet")


def main() -> None:
    args = stage_parser(__doc__).parse_args()
    params = stage_params(args.stage or "word_regions")
    log = setup_logging("word_regions")
    instances_path, captions_path = params["word_regions.instances"], params["word_regions.captions"]
    frame, meta = build_word_regions(load_json(instances_path), load_json(captions_path),
                                     lemmatizer=params["word_regions.lemmatizer"],
                                     instance_rule=params["word_regions.instance_rule"],
                                     synonyms=params["word_regions.synonyms"],
                                     instances_path=instances_path, captions_path=captions_path)
    meta = {"instances_file": instances_path, "captions_file": captions_path, **meta}
    write_parquet(OUT, frame)
    write_json(OUT.with_name("word_regions.meta.json"), meta)
    log.info("%d word-region rows from %d of %d captions (%d dropped: no category word matched)",
             meta["rows"], meta["captions_matched"], meta["captions"], meta["captions_dropped_no_match"])
    params.check_all_read()


if __name__ == "__main__":
    main()
