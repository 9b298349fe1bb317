"""`python -m benchmarks --scale [--fraction F]`: a COCO-sized rehearsal of the CPU data stages (issue 34 item 3).

Generates, deterministically and fast, a corpus with COCO train2017's cardinality (118,287 images, 591,753
captions, 860,001 instances; 32 x 32 JPEGs, captions naming the instances' categories) and DOCCI train's 9,647
long descriptions (32 x 32 JPEGs, 6-9 sentences each), times `F` of it (`--fraction`, default 1), then runs the
CPU stages' library code on it, each in its own forked process so its peak RSS is its own:
word_regions, sentences, shards (per source, with index.json), `epoch_coverage` (what `clipfinetune plan`
computes from the index: batch 256, 8 ranks x 8 workers, every (image, caption) pair), leakage (content digests of
every training image against a 5,000-image evaluation set), one loader epoch at `train.epoch_unit: method` (plain CLIP:
every (image, caption) pair once, batch 256, 2 workers, a trivial transform: the data path, not the model), and the
negatives client against 34A's local stub (`benchmarks.fig6_negatives.run_client_against_stub`, one request per
caption, 256 in flight). Prints each stage's wall time and peak RSS; targets on 2 cores: <= 15 min and < 8 GB.
Scratch: benchmarks/_work/scale-<F>/ (replaced each run).
"""
from __future__ import annotations

import io
import json
import multiprocessing as mp
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

from .common import WORK

COCO_IMAGES, COCO_CAPTIONS, COCO_INSTANCES, DOCCI_TRAIN = 118_287, 591_753, 860_001, 9_647
EVAL_IMAGES = 5_000
TARGET_S, TARGET_GB = 15 * 60, 8.0
CATEGORIES = ["person", "dog", "cat", "car", "bus", "chair", "horse", "bird", "boat", "cup", "pizza", "train",
              "clock", "bench", "umbrella", "bottle", "giraffe", "zebra", "elephant", "kite"]
PLACES = ["on a street", "in a field", "near the water", "in a kitchen", "by the window", "under a tree"]
JPEG_VARIANTS = 512


def _jpegs(n: int, size: int) -> list[bytes]:
    """`n` distinct small JPEGs (a colour per variant), encoded once; files reuse them round-robin."""
    from PIL import Image

    out = []
    for i in range(n):
        buf = io.BytesIO()
        Image.new("RGB", (size, size), (i * 37 % 256, i * 91 % 256, i * 53 % 256)).save(buf, "JPEG", quality=80)
        out.append(buf.getvalue())
    return out


def _spread(total: int, n: int) -> list[int]:
    """`total` items over `n` owners: total // n each, one more for the first total % n."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def generate(root: Path, fraction: float) -> dict:
    import random

    n_img, n_docci = max(2, round(COCO_IMAGES * fraction)), max(2, round(DOCCI_TRAIN * fraction))
    n_cap, n_inst = max(n_img, round(COCO_CAPTIONS * fraction)), max(n_img, round(COCO_INSTANCES * fraction))
    jpegs, eval_jpegs = _jpegs(JPEG_VARIANTS, 32), _jpegs(JPEG_VARIANTS, 40)   # eval: other bytes, no overlap
    (root / "coco").mkdir(parents=True)
    (root / "docci").mkdir()
    (root / "eval").mkdir()
    cats = [{"id": i + 1, "name": name, "supercategory": "thing"} for i, name in enumerate(CATEGORIES)]
    images, captions, instances = [], [], []
    caps_per, inst_per = _spread(n_cap, n_img), _spread(n_inst, n_img)
    for i in range(n_img):
        rng = random.Random(f"coco:{i}")
        image_id, name = i + 1, f"{i + 1:012d}.jpg"
        (root / "coco" / name).write_bytes(jpegs[i % JPEG_VARIANTS])
        images.append({"id": image_id, "file_name": name, "width": 32, "height": 32})
        present = [rng.randrange(len(CATEGORIES)) for _ in range(inst_per[i])]
        for c in present:
            x, y = rng.randrange(0, 24), rng.randrange(0, 24)
            w, h = rng.randrange(4, 32 - x), rng.randrange(4, 32 - y)
            instances.append({"id": len(instances) + 1, "image_id": image_id, "category_id": c + 1,
                              "bbox": [x, y, w, h], "area": w * h, "iscrowd": 0})
        for _ in range(caps_per[i]):
            a, b = CATEGORIES[rng.choice(present)], CATEGORIES[rng.randrange(len(CATEGORIES))]
            captions.append({"id": len(captions) + 1, "image_id": image_id,
                             "caption": f"A {a} next to a {b} {rng.choice(PLACES)}."})
    (root / "captions.json").write_text(json.dumps({"images": images, "annotations": captions}))
    (root / "instances.json").write_text(json.dumps({"images": images, "annotations": instances,
                                                     "categories": cats}))
    with open(root / "docci.jsonlines", "w") as f:
        for i in range(n_docci):
            rng = random.Random(f"docci:{i}")
            name = f"train_{i:05d}.jpg"
            (root / "docci" / name).write_bytes(jpegs[(i + 7) % JPEG_VARIANTS])
            sentences = [f"A {rng.choice(CATEGORIES)} stands {rng.choice(PLACES)} beside a {rng.choice(CATEGORIES)}, "
                         f"its colour {rng.choice(['red', 'blue', 'green', 'grey'])} in the light."
                         for _ in range(rng.randrange(6, 10))]
            f.write(json.dumps({"example_id": f"train_{i:05d}", "split": "train", "image_file": name,
                                "description": " ".join(sentences)}) + "\n")
    for i in range(EVAL_IMAGES):
        (root / "eval" / f"{i:06d}.jpg").write_bytes(eval_jpegs[i % JPEG_VARIANTS])
    return {"coco_images": n_img, "captions": len(captions), "instances": len(instances), "docci": n_docci}


def _sources(root: Path) -> dict:
    return {"coco": {"reader": "coco", "captions": str(root / "captions.json"), "images": str(root / "coco"),
                     "instances": str(root / "instances.json")},
            "docci": {"reader": "docci", "descriptions": str(root / "docci.jsonlines"), "images": str(root / "docci")}}


def word_regions(root: Path) -> dict:
    from clipfinetune.data.prepare.word_regions import build_word_regions
    from clipfinetune.data.readers.coco import load_json
    from clipfinetune.io import write_parquet

    frame, meta = build_word_regions(load_json(root / "instances.json"), load_json(root / "captions.json"))
    write_parquet(root / "prepared" / "word_regions.parquet", frame)
    return {"rows": meta["rows"]}


def sentences(root: Path) -> dict:
    from clipfinetune.data.prepare.sentences import split_sentences
    from clipfinetune.data.readers import read_source
    from clipfinetune.io import write_parquet

    frame, meta = split_sentences(read_source("docci", _sources(root)["docci"]), max_sentences=15)
    write_parquet(root / "prepared" / "sentences.parquet", frame)
    return {"rows": meta["rows"]}


def shards(root: Path) -> dict:
    import pandas as pd

    from clipfinetune.data.prepare.shards import REQUIRED, build_shards
    from clipfinetune.io import write_parquet

    for kind in ("negatives", "local_pairs"):       # not produced on CPU here: empty tables of the right schema
        write_parquet(root / "prepared" / f"{kind}.parquet", pd.DataFrame({c: [] for c in REQUIRED[kind]}))
    meta = build_shards(root / "shards", prepared_dir=root / "prepared", sources=_sources(root),
                        prepared_from={"word_regions": "coco", "negatives": "coco", "local_pairs": "docci",
                                       "sentences": ["docci"]}, splits=["train"], maxcount=1000, val_fraction=0.0)
    return {"samples": meta["samples_train"], "shards": meta["shards"]["train"]}


def leakage_check(root: Path) -> dict:
    from clipfinetune import leakage

    train = leakage.training_images(_sources(root), ["train"])
    evals = {"retrieval.scale": [leakage.ImageRef(str(p), None) for p in sorted((root / "eval").iterdir())]}
    overlaps, cost = leakage.find_overlaps(train, evals, root / "leakage_cache")
    return {"train_images": cost["train_images"], "overlaps": len(overlaps)}


def loader_epoch(root: Path) -> dict:
    import numpy as np
    import torch

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods.clip import ClipMethod

    ctx = ExampleContext(lambda im: torch.from_numpy(np.array(im.resize((8, 8)), dtype=np.uint8)),
                         tokenize=lambda texts: torch.zeros(len(texts), 77, dtype=torch.long), image_size=8)
    loader = ShardLoader(root / "shards", "train", ClipMethod(), ctx, batch_size=256, num_workers=2,
                         epoch_unit="method")
    n = sum(len(b["text"]) for b in loader.batches(0))
    return {"units": loader.num_units, "examples": n, "shards_opened": len(loader.paths)}


def coverage_plan(root: Path) -> dict:
    """`clipfinetune plan`'s epoch coverage (data/loader.py `epoch_coverage`) at params.real.yaml's batch 256 on
    8 GPUs x 8 loader workers, every (image, caption) pair a unit: from the shard index, no image decoded."""
    from clipfinetune.data.loader import epoch_coverage
    from clipfinetune.methods.clip import ClipMethod

    cov = epoch_coverage(root / "shards", "train", ClipMethod(), global_batch=256, world_size=8, num_workers=8,
                         epoch_unit="method")
    return {k: cov[k] for k in ("units", "steps_per_epoch", "seen", "repeated")}


def negatives_client(root: Path) -> dict:
    from .fig6_negatives import run_client_against_stub

    n = json.loads((root / "counts.json").read_text())["captions"]
    out = run_client_against_stub(n_requests=n, in_flight=256)
    return {"requests": out["requests"], "requests_per_s": round(out["requests_per_s"]), "failed": out["failed"]}


STAGES = [("word_regions", word_regions), ("sentences", sentences), ("shards", shards),
          ("epoch coverage (plan, 8 x 8 readers)", coverage_plan), ("leakage", leakage_check),
          ("loader epoch (method)", loader_epoch), ("negatives client", negatives_client)]


def _child(fn, root: Path, conn) -> None:
    t = time.perf_counter()
    try:
        result = fn(root)
        error = None
    except Exception as e:  # noqa: BLE001  (reported in the table, the other stages still run)
        result, error = {}, f"{type(e).__name__}: {e}"
    conn.send({"seconds": time.perf_counter() - t, "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               / 2 ** 20, "result": result, "error": error})
    conn.close()


def timed(fn, root: Path) -> dict:
    """`fn(root)` in a forked process: its wall time and its own peak RSS (ru_maxrss of that process)."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, root, child))
    proc.start()
    child.close()
    try:
        out = parent.recv()
    except EOFError:            # the child died without a word (killed, os._exit)
        out = None
    proc.join()
    if out is None and proc.exitcode is not None and proc.exitcode < 0:
        # e.g. SIGKILL from the kernel's OOM killer (see `dmesg`): say which signal, not a bare negative code
        how = f"killed by {signal.Signals(-proc.exitcode).name}" + (
            " (out of memory? see dmesg)" if proc.exitcode == -signal.SIGKILL else "")
    else:
        how = f"exited {proc.exitcode}"
    return out or {"seconds": float("nan"), "peak_gb": float("nan"), "result": {},
                   "error": f"process {how} without a result"}


def rehearsal(fraction: float = 1.0, log=print) -> list[dict]:
    root = WORK / f"scale-{fraction:g}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = []
    gen = timed(lambda r: generate(r, fraction), root)
    if gen.get("error"):
        raise RuntimeError(f"generating the corpus failed: {gen['error']}")
    (root / "counts.json").write_text(json.dumps(gen["result"]))
    rows.append({"stage": "generate corpus", **gen})
    log(f"corpus ({fraction:g} of COCO train2017 + DOCCI train): {gen['result']}")
    (root / "prepared").mkdir()
    for name, fn in STAGES:
        out = timed(fn, root)
        rows.append({"stage": name, **out})
        log(f"{name}: {out['seconds']:.1f} s, peak {out['peak_gb']:.2f} GB, {out['result'] or out['error']}")
    return rows


def record_rates(rows: list[dict]) -> None:
    """The CPU data stages' rates at full size into benchmarks/calibration.json (`clipfinetune plan`'s estimates)."""
    from .calibration import record, source

    counts = rows[0]["result"]
    by = {r["stage"]: r for r in rows if r.get("error") is None}
    src = source("python -m benchmarks --scale")
    figures = []
    for stage, n, unit in (("word_regions", counts["captions"], "captions/s"),
                           ("sentences", counts["docci"], "descriptions/s")):
        if stage in by:
            figures.append({"device": "cpu", "what": stage, "arch": "", "method": "",
                            "value": round(n / by[stage]["seconds"], 1), "unit": unit, "per": "process",
                            "settings": f"{stage} library code on the COCO-sized corpus",
                            "source": f"{src}: {by[stage]['seconds']:.1f} s"})
    record(figures)


def table(rows: list[dict], fraction: float) -> str:
    head = ["stage", "wall s", "peak GB", "target (2 cores)", "pass", "what"]
    body = []
    for r in rows:
        ok = r.get("error") is None and r["seconds"] <= TARGET_S and r["peak_gb"] < TARGET_GB
        body.append([r["stage"], f"{r['seconds']:.1f}", f"{r['peak_gb']:.2f}",
                     "-" if r["stage"] == "generate corpus" else "<= 900 s, < 8 GB",
                     "info" if r["stage"] == "generate corpus" else ("PASS" if ok else "FAIL"),
                     r.get("error") or json.dumps(r["result"])])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    title = f"COCO-sized rehearsal, fraction {fraction:g}"
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *map(line, body)])


def main(fraction: float) -> int:
    rows = rehearsal(fraction, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(table(rows, fraction))
    if fraction == 1.0:
        record_rates(rows)
    return 0 if all(r.get("error") is None for r in rows) else 1
