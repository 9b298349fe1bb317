"""Stage `sentences` (MulCLIP, GOAL): DOCCI long captions -> data/prepared/sentences.parquet + meta."""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
from _common import setup_logging, stage_params, stage_parser

from clipfinetune.data.prepare.sentences import read_docci, split_sentences
from clipfinetune.io import write_json, write_parquet

OUT = Path("data/prepared/sentences.parquet")


def main() -> None:
    args = stage_parser(__doc__).parse_args()
    params = stage_params(args.stage or "sentences")
    log = setup_logging("sentences")
    docci = params["sentences.docci"]
    records = read_docci(docci)        # every split: LISM also builds GOAL's joint test list
    frame, meta = split_sentences(records, max_sentences=params["sentences.max_sentences"])
    meta = {"docci_file": docci, "records": len(records), **meta}
    write_parquet(OUT, frame)
    write_json(OUT.with_name("sentences.meta.json"), meta)
    log.info("%d sentences from %d long captions (%s); %d dropped over the cap of %d, %d empty captions skipped",
             meta["rows"], meta["long_captions"], meta["segmenter"], meta["sentences_dropped_over_cap"],
             meta["max_sentences"], meta["empty_long_captions_skipped"])
    params.check_all_read()


if __name__ == "__main__":
    main()
