"""Stage `evalsets`: every file the configured evaluation sets read -> data/evalsets.json
({"<task>.<set>": {file: [size, BLAKE2b]}}, `clipfinetune.data.evalsets.sets.evalset_manifest`).

DVC cannot take a profile's evaluation-set files as deps (they are nested under `eval.evalsets` and differ per
profile), so this stage runs on every `dvc repro` (always_changed) and eval@<model> depends on its output, which
changes only when one of those files does: an edited file re-runs every eval, an unchanged one none. Digests are cached
(data/cache/leakage, shared with the leakage check), so a re-run costs one stat per file.
Run by hand: python stages/evalsets.py --stage evalsets
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import start

from clipfinetune.data.evalsets.sets import evalset_manifest
from clipfinetune.digests import DIGEST_CACHE
from clipfinetune.io import write_json

OUT = "data/evalsets.json"


def main() -> None:
    _, params, log = start(__doc__, "evalsets")
    t0 = time.perf_counter()
    manifest, cost = evalset_manifest(params["eval.evalsets"], DIGEST_CACHE)
    write_json(OUT, manifest)
    log.info("%d sets, %s in %.1fs", len(manifest), cost, time.perf_counter() - t0)
    params.check_all_read()


if __name__ == "__main__":
    main()
