"""Stage `sample@world`: generate the embedded sample world (docs/design.md §8) into data/sample, atomically.

dvc.yaml runs it once per entry of params `sample.build` ([world]; [] in the real-data profile, where no stage reads
data/sample), so it is in the DAG only where the sample world is used."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import ROOT, start

from clipfinetune.io import atomic_path
from clipfinetune.sample.world import WorldConfig, generate_world

OUT = ROOT / "data" / "sample"
KEYS = ["seed", "image_size", "n_train", "n_val", "n_docci_train", "n_docci_test", "n_compositional",
        "n_zeroshot_per_class", "n_pretrain"]


def main() -> None:
    _, params, log = start(__doc__, "sample@world")
    cfg = WorldConfig(**{k: int(params[f"sample.{k}"]) for k in KEYS})
    params.check_all_read()
    t0 = time.perf_counter()
    with atomic_path(OUT, is_dir=True) as tmp:
        meta = generate_world(tmp, cfg)
    log.info("wrote %s in %.1f s: %s", OUT.relative_to(ROOT), time.perf_counter() - t0, meta["counts"])


if __name__ == "__main__":
    main()
