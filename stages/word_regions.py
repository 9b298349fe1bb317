"""Stage `word_regions` (HarmoCLIP): a COCO source's instances + captions -> data/prepared/word_regions.parquet
+ meta."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import source_specs, start_preparing

from clipfinetune.data.prepare.word_regions import build_word_regions
from clipfinetune.data.readers.coco import load_json
from clipfinetune.io import write_json, write_parquet

OUT = Path("data/prepared/word_regions.parquet")


def main() -> None:
    name, params, log = start_preparing(__doc__, "word_regions")
    spec = source_specs(params, name)[name]
    if spec.get("reader") != "coco" or not spec.get("instances"):
        raise SystemExit(f"word_regions.sources: {name!r} must be a COCO source with `instances` (got {spec})")
    instances_path, captions_path = spec["instances"], spec["captions"]
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
