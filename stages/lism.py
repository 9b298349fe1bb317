"""Stage `lism` (GOAL/LISM step 2): sentence-region matching on the train and test images of `lism.source`.

Writes data/prepared/local_pairs.parquet (every per-sentence match of the train split, `chosen` marking
the image's training pair), GOAL's joint global+local test list for the test split (data/prepared/global_local/test.json
with its images), and metrics/lism.json: on the sample world, where the generator knows which object each
sentence describes, LISM's accuracy against that ground truth; on real data (`lism.ground_truth: ""`) the pair
counts only. It never reads the instances files; the ground truth is read only to measure.
"""
from __future__ import annotations

from pathlib import Path

import _common  # noqa: F401  (puts the repo on sys.path)
import pandas as pd
from _common import source_specs, start

from clipfinetune.data.prepare.lism import measure_against_ground_truth, read_ground_truth, run_lism
from clipfinetune.data.readers import read_source
from clipfinetune.eval.global_local import write_test_list
from clipfinetune.io import atomic_path, write_json, write_parquet

OUT = Path("data/prepared/local_pairs.parquet")
TEST_DIR = Path("data/prepared/global_local")


def load_model_for_lism(name: str, pretrained: str):
    from clipfinetune.models import load_model

    if Path(name).is_dir():  # an exported folder, e.g. the sample world's models/base
        return load_model(f"local-dir:{name}")
    return load_model(name, pretrained=pretrained)


def main() -> None:
    _, params, log = start(__doc__, "lism")
    name = params["lism.source"]
    records = read_source(name, source_specs(params, name)[name])
    sentences = pd.read_parquet(params["lism.sentences"])
    segments = pd.read_parquet(params["lism.segments"])
    model = load_model_for_lism(params["lism.model"], params["lism.pretrained"]).eval()
    with atomic_path(TEST_DIR, is_dir=True) as test_dir:
        train_rows, tests, meta = run_lism(records, sentences, segments, model, params["lism.batch_size"], test_dir)
        write_test_list(test_dir, tests)
    write_parquet(OUT, pd.DataFrame(train_rows))
    meta = {"model": params["lism.model"], **meta}
    write_json(OUT.with_name("local_pairs.meta.json"), meta)
    truth_path = params["lism.ground_truth"]
    if truth_path and Path(truth_path).exists():
        rows = [{**r, "box": (r["x0"], r["y0"], r["x1"], r["y1"])} for r in train_rows]
        scores = measure_against_ground_truth(rows, read_ground_truth(truth_path, sentences), meta["n_train_images"])
        log.info("LISM vs ground truth: %s", scores)
    else:  # real data: nothing to measure against; the metrics file (a DVC output) holds the counts
        scores = {"n_images": meta["n_train_images"], "n_pairs": meta["n_pairs"], "global_wins": meta["global_wins"]}
        log.info("no lism.ground_truth: LISM not measured (real data)")
    write_json("metrics/lism.json", {"lism": scores})
    log.info("%s", {k: v for k, v in meta.items() if k != "skipped"})
    params.check_all_read()


if __name__ == "__main__":
    main()
