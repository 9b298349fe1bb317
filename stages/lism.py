"""Stage `lism` (GOAL/LISM step 2): sentence-region matching on DOCCI train and test images.

Writes data/prepared/local_pairs.parquet (every per-sentence match of the train split, `chosen` marking
the image's training pair), GOAL's joint global+local test list for the test split (data/prepared/global_local/test.json
with its images), and metrics/lism.json: on the sample world, where the generator knows which object each
sentence describes, LISM's accuracy against that ground truth; on real data (`lism.ground_truth: ""`) the pair
counts only. It never reads the instances files; the ground truth is read only to measure.
"""
from __future__ import annotations

import json
from pathlib import Path

import _common  # noqa: F401
import pandas as pd
from _common import setup_logging, stage_params, stage_parser

from clipfinetune.data.prepare.lism import (
    choose_test_pair,
    choose_training_pair,
    match_image,
    measure_against_ground_truth,
)
from clipfinetune.io import InputError, atomic_path, read_image, read_jsonlines, write_json, write_parquet

OUT = Path("data/prepared/local_pairs.parquet")
TEST_DIR = Path("data/prepared/global_local")
SPLITS = ("train", "test")  # DOCCI's qual_dev / qual_test are neither trained on nor in the test list (counted)


def load_model_for_lism(name: str, pretrained: str):
    from clipfinetune.models import load_model

    if Path(name).is_dir():  # an exported folder, e.g. the sample world's models/base
        return load_model(f"local-dir:{name}")
    return load_model(name, pretrained=pretrained)


def read_docci(path: Path) -> dict[str, dict]:
    records = {}
    for line_no, rec in read_jsonlines(path):
        try:
            image_id = str(rec["example_id"])
        except (KeyError, TypeError) as e:
            raise InputError(path, f"line {line_no}", f"not a DOCCI record ({e})") from e
        if image_id in records:
            raise InputError(path, image_id, f"duplicate example_id (line {line_no})")
        records[image_id] = rec
    return records


def main() -> None:
    args = stage_parser(__doc__).parse_args()
    params = stage_params(args.stage or "lism")
    log = setup_logging("lism")
    docci = read_docci(Path(params["lism.docci"]))
    images_dir = Path(params["lism.images"])
    sentences = pd.read_parquet(params["lism.sentences"])
    segments = pd.read_parquet(params["lism.segments"])
    model = load_model_for_lism(params["lism.model"], params["lism.pretrained"]).eval()
    batch_size = params["lism.batch_size"]

    by_image = {k: g.sort_values("sentence_index") for k, g in sentences.groupby("image_id")}
    boxes_of = {k: [tuple(r) for r in g[["x0", "y0", "x1", "y1"]].itertuples(index=False)]
                for k, g in segments.groupby("image_id")}
    train_rows, test_items, skipped, other_splits = [], [], [], {}
    with atomic_path(TEST_DIR, is_dir=True) as test_dir:
        for image_id in sorted(docci):
            rec = docci[image_id]
            if _split(rec) not in SPLITS:
                other_splits[_split(rec)] = other_splits.get(_split(rec), 0) + 1
                continue
            if image_id not in by_image:
                skipped.append({"image_id": image_id, "reason": "no sentences"})
                continue
            path = images_dir / rec["image_file"]
            try:
                image = read_image(path, record=image_id)
            except InputError as e:
                skipped.append({"image_id": image_id, "file": str(path), "reason": str(e)})
                continue
            texts = by_image[image_id]["text"].tolist()
            idx = by_image[image_id]["sentence_index"].tolist()
            boxes = boxes_of.get(image_id, [])
            matches = match_image(model, image, texts, boxes, batch_size)
            full = (0.0, 0.0, float(image.width), float(image.height))
            if _split(rec) == "test":
                test_items.append(_test_entry(image, image_id, rec, texts, boxes, matches, test_dir))
                continue
            chosen = choose_training_pair(matches)
            for m in matches:
                box = boxes[m.candidate - 1] if m.candidate else full
                train_rows.append({"image_id": image_id, "sentence_index": idx[m.sentence_index],
                                   "sentence": texts[m.sentence_index].strip(), "x0": box[0], "y0": box[1],
                                   "x1": box[2], "y1": box[3], "score": m.score, "chosen": m is chosen,
                                   "kind": "region" if m.candidate else "global"})
        # GOAL's joint list: global items first, then one local item per image.
        globals_, locals_ = zip(*test_items) if test_items else ((), ())
        (test_dir / "test.json").write_text(json.dumps([*globals_, *locals_], indent=1))

    frame = pd.DataFrame(train_rows)
    write_parquet(OUT, frame)
    n_train = sum(1 for r in docci.values() if _split(r) == "train")
    train_skipped = sum(1 for s in skipped if _split(docci[s["image_id"]]) == "train")
    meta = {"model": params["lism.model"], "n_train_images": n_train, "n_test_images": len(test_items),
            "n_pairs": int(frame["chosen"].sum()) if len(frame) else 0,
            "global_wins": n_train - train_skipped - (int(frame["chosen"].sum()) if len(frame) else 0),
            "skipped": skipped, "other_splits": other_splits}
    write_json(OUT.with_name("local_pairs.meta.json"), meta)
    truth_path = params["lism.ground_truth"]
    if truth_path and Path(truth_path).exists():
        truth = _read_truth(Path(truth_path), docci, by_image)
        rows = [{**r, "box": (r["x0"], r["y0"], r["x1"], r["y1"])} for r in train_rows]
        scores = measure_against_ground_truth(rows, truth, n_train)
        log.info("LISM vs ground truth: %s", scores)
    else:  # real data: nothing to measure against; the metrics file (a DVC output) holds the counts
        scores = {"n_images": n_train, "n_pairs": meta["n_pairs"], "global_wins": meta["global_wins"]}
        log.info("no lism.ground_truth: LISM not measured (real data)")
    write_json("metrics/lism.json", {"lism": scores})
    log.info("%s", {k: v for k, v in meta.items() if k != "skipped"})
    params.check_all_read()


def _split(rec: dict) -> str:
    return str(rec.get("split", "train"))     # a record without a split (e.g. a custom file) is training data


def _test_entry(image, image_id, rec, texts, boxes, matches, test_dir: Path):
    """GOAL's joint test list items (BENCHMARKS §7.1), paths relative to data/prepared/global_local/."""
    stem = Path(rec["image_file"]).stem
    global_name = f"photos/{stem}.jpg"
    (test_dir / "photos").mkdir(exist_ok=True)
    image.save(test_dir / global_name, quality=95)
    best = choose_test_pair(matches)
    seg_dir = test_dir / "segments" / f"{stem}.jpg_results"
    seg_dir.mkdir(parents=True, exist_ok=True)
    if best.candidate:
        crop = image.crop(tuple(round(v) for v in boxes[best.candidate - 1]))
        local_name = f"segments/{stem}.jpg_results/{stem}_max_{best.candidate}.png"
        crop.save(test_dir / local_name)
    else:  # the global image won: the local item is the image itself, as in GOAL's shipped list
        local_name = f"segments/{stem}.jpg_results/original_image.jpg"
        image.save(test_dir / local_name, quality=95)
    return ({"filename": global_name, "caption": rec["description"], "image_id": image_id},
            {"filename": local_name, "caption": texts[best.sentence_index],
             "similarity_score": round(best.score, 4), "image_id": image_id})


def _read_truth(path: Path, docci, by_image) -> dict:
    """{(image_id, sentence text): box}; sentences are matched by text, so the sentence splitter may differ."""
    truth = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            image_id = str(rec["example_id"])
            text = rec.get("sentence")
            if text is None and image_id in by_image:
                g = by_image[image_id]
                hit = g[g["sentence_index"] == rec["sentence_index"]]
                text = hit["text"].iloc[0] if len(hit) else None
            if text is not None:
                truth[(image_id, text.strip())] = tuple(rec["box"])
    return truth


if __name__ == "__main__":
    main()
