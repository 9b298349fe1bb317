"""Stage `lism` (GOAL/LISM step 2): sentence-region matching on the train and test images of `lism.source`.

Writes data/prepared/local_pairs.parquet (every per-sentence match of the train split, `chosen` marking
the image's training pair), GOAL's joint global+local test list for the test split (data/evalsets/global_local/test.json
with its images), and metrics/lism.json: on the sample world, where the generator knows which object each
sentence describes, LISM's accuracy against that ground truth; on real data (`lism.ground_truth: ""`) the pair
counts only. It never reads the instances files; the ground truth is read only to measure.

The model runs on the device of `compute.device` (stages/_items.py; recorded in local_pairs.meta.json). The images (by
id) are cut into work units of UNIT_IMAGES; under torchrun each rank matches its units (images decoded and crops cut
in DataLoader workers, as many as the host offers a rank: clipfinetune/host.py) and writes one part file per unit
under data/cache/lism/<fingerprint>/, with the unit's test images' files of GOAL's test list (the original linked, the
chosen crop as a PNG) beside it; rank 0 assembles them in image order, links the files into the test list's folder and
writes every output, so a sharded run writes exactly what one process writes, and a killed run resumes from its parts.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages import _items
from stages._common import ITEMS, source_specs, start_preparing

import pandas as pd

from clipfinetune import host
from clipfinetune.data.evalsets.global_local import place_files, write_test_list
from clipfinetune.data.prepare.lism import (
    Matcher,
    assemble_lism,
    lism_inputs,
    measure_against_ground_truth,
    read_ground_truth,
    texts_of,
)
from clipfinetune.data.readers import read_source
from clipfinetune.io import atomic_path, write_json, write_parquet
from clipfinetune.parts import work_units

OUT = Path("data/prepared/local_pairs.parquet")
TEST_DIR = Path("data/evalsets/global_local")
# images per part file by device type; on a GPU also the images whose crops share batches
UNIT_IMAGES = {"cpu": 4, "cuda": 64}


def load_model_for_lism(name: str, pretrained: str, device="cpu"):
    from clipfinetune.models import load_model

    if Path(name).is_dir():  # an exported folder, e.g. the sample world's models/base
        return load_model(f"local-dir:{name}", device=device)
    return load_model(name, pretrained=pretrained, device=device)


def main() -> None:
    name, params, log = start_preparing(__doc__, "lism", ITEMS)
    dist = _items.setup_device(params)
    records = sorted(read_source(name, source_specs(params, name)[name]), key=lambda r: r.image_id)
    sentences = pd.read_parquet(params["lism.sentences"])
    by_image, boxes_of = lism_inputs(sentences, pd.read_parquet(params["lism.segments"]))
    model = load_model_for_lism(params["lism.model"], params["lism.pretrained"], dist.device).eval()
    batch_size = params["lism.batch_size"]
    settings = {"source": name, "model": params["lism.model"], "pretrained": params["lism.pretrained"],
                "sentences": params["lism.sentences"], "segments": params["lism.segments"], "batch_size": batch_size,
                "unit_images": UNIT_IMAGES[dist.device.type]}
    store = _items.part_store(params, settings, dist.device)      # workers change no result: not in the key
    matcher = Matcher(model, texts_of(by_image), boxes_of, batch_size, store.files_dir, host.count("lism"))
    results = _items.run_sharded(store, work_units(records, settings["unit_images"]), lambda r: r.image_id,
                                 matcher, dist, log, "lism", stream=True)
    log.info("lism: rank %d matched %d images (%d candidates) and wrote %d test images' items", dist.rank,
             matcher.counts["images"], matcher.counts["candidates"], matcher.counts["test_items"])
    truth_path = params["lism.ground_truth"]
    params.check_all_read()
    if results is None:               # not rank 0: its parts are written
        _items.finish(dist)
        return
    train_rows, tests, meta = assemble_lism(records, [r for unit in results for r in unit], by_image, boxes_of)
    with atomic_path(TEST_DIR, is_dir=True) as test_dir:
        place_files(tests, store.files_dir, test_dir)        # links: the units wrote the files
        write_test_list(test_dir, tests)
    write_parquet(OUT, pd.DataFrame(train_rows))
    meta = {"model": params["lism.model"], "device": str(dist.device), "precision": "fp32", **meta}   # no autocast
    write_json(OUT.with_name("local_pairs.meta.json"), meta)
    if truth_path and Path(truth_path).exists():
        rows = [{**r, "box": (r["x0"], r["y0"], r["x1"], r["y1"])} for r in train_rows]
        scores = measure_against_ground_truth(rows, read_ground_truth(truth_path, sentences), meta["n_train_images"])
        log.info("LISM vs ground truth: %s", scores)
    else:  # real data: nothing to measure against; the metrics file (a DVC output) holds the counts
        scores = {"n_images": meta["n_train_images"], "n_pairs": meta["n_pairs"], "global_wins": meta["global_wins"]}
        log.info("no lism.ground_truth: LISM not measured (real data)")
    write_json("metrics/lism.json", {"lism": scores})
    log.info("%s", {k: v for k, v in meta.items() if k != "skipped"})
    store.clear()
    _items.finish(dist)


if __name__ == "__main__":
    main()
