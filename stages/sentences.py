"""Stage `sentences` (MulCLIP, GOAL): the long captions of `sentences.sources` -> data/prepared/sentences.parquet
+ meta."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import source_specs, start_preparing

from clipfinetune.data.prepare.sentences import split_sentences
from clipfinetune.data.readers import read_source, source_paths
from clipfinetune.io import write_json, write_parquet

OUT = Path("data/prepared/sentences.parquet")


def main() -> None:
    name, params, log = start_preparing(__doc__, "sentences")
    specs = source_specs(params, name)
    records = [r for name, spec in specs.items() for r in read_source(name, spec)]   # every split
    frame, meta = split_sentences(records, max_sentences=params["sentences.max_sentences"],
                                  splitter=params["sentences.splitter"])
    files = {f"{name}_file": source_paths(spec)[0] for name, spec in specs.items()}
    meta = {**files, "records": len(records), **meta}
    write_parquet(OUT, frame)
    write_json(OUT.with_name("sentences.meta.json"), meta)
    log.info("%d sentences from %d long captions (%s); %d dropped over the cap of %d, %d empty captions skipped",
             meta["rows"], meta["long_captions"], meta["segmenter"], meta["sentences_dropped_over_cap"],
             meta["max_sentences"], meta["empty_long_captions_skipped"])
    params.check_all_read()


if __name__ == "__main__":
    main()
