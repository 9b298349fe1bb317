"""LISM's matching with its images decoded in DataLoader workers against decoding in the rank's own thread.

`python -m benchmarks.lism_workers [--images 24] [--size 1024x768] [--boxes 12] [--workers 2] [--rounds 3]`

The `lism` stage's `Matcher` (clipfinetune/data/prepare/lism.py) over one list of DOCCI-like records written here:
`--images` JPEGs of `--size` (shapes on a noisy background), `--boxes` segment boxes and 3-6 sentences each, every
third a test image (DOCCI: 5,000 test of 14,647), whose items of GOAL's test list are written too. The matcher is the
sample world's tiny CLIP (`cft-tiny-vit`, random weights: the scores do not matter, the time does) on the CPU, its
forwards at one thread as the stage runs them. `workers 0` decodes each image, cuts its crops and transforms them in
the calling thread (what every rank did before); `--workers N` does that in N DataLoader workers while the main
thread runs the forwards. Rounds alternate the order; candidates (the image + its crops) per second, median over
rounds, and the ratio workers / main thread. With a model whose forward dominates (ViT-L-14-336 on a CPU) the
ratio tends to 1; on a GPU, where the forward is fast, the decoding is what bounds a rank.
Scratch: benchmarks/_work/lism_workers/ (replaced each run).
"""
from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time

from .common import WORK


def write_records(root, n: int, size: tuple[int, int], n_boxes: int):
    """(records, {image_id: sentences}, {image_id: boxes}) of `n` JPEGs of `size` under `root`."""
    import numpy as np
    from PIL import Image, ImageDraw

    from clipfinetune.data.readers import Record

    rng, gen = random.Random(0), np.random.default_rng(0)
    w, h = size
    records, texts, boxes = [], {}, {}
    root.mkdir(parents=True)
    for k in range(n):
        image_id = f"{'test' if k % 3 == 0 else 'train'}_{k:05d}"
        image = Image.fromarray(gen.integers(60, 120, (h, w, 3), dtype=np.uint8))
        draw = ImageDraw.Draw(image)
        boxes[image_id] = []
        for _ in range(n_boxes):
            x, y = rng.uniform(0, w * 0.7), rng.uniform(0, h * 0.7)
            box = (x, y, x + rng.uniform(w * 0.1, w * 0.3), y + rng.uniform(h * 0.1, h * 0.3))
            draw.ellipse(box, fill=tuple(rng.randrange(256) for _ in range(3)))
            boxes[image_id].append(box)
        image.save(root / f"{image_id}.jpg", quality=90)
        texts[image_id] = [f"A {c} shape number {j} lies on the grey ground." for j, c in
                           enumerate(rng.sample(["red", "blue", "green", "yellow", "pink", "brown"], rng.randint(3, 6)))]
        records.append(Record("docci", image_id, f"{image_id}.jpg", root, split=image_id.split("_")[0],
                              long_caption=" ".join(texts[image_id])))
    return records, texts, boxes


def candidates_per_s(model, records, texts, boxes, workers: int, files_dir, batch_size: int = 64) -> float:
    from clipfinetune.data.prepare.lism import Matcher

    shutil.rmtree(files_dir, ignore_errors=True)
    matcher = Matcher(model, texts, boxes, batch_size, files_dir, workers=workers)
    t0 = time.perf_counter()
    for _ in matcher([records[i:i + 4] for i in range(0, len(records), 4)]):       # the stage's CPU unit: 4 images
        pass
    return matcher.counts["candidates"] / (time.perf_counter() - t0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--size", default="1024x768", help="width x height of each image")
    ap.add_argument("--boxes", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    import torch

    from clipfinetune.models import load_model

    work = WORK / "lism_workers"
    shutil.rmtree(work, ignore_errors=True)
    records, texts, boxes = write_records(work / "images", a.images, tuple(int(v) for v in a.size.split("x")), a.boxes)
    torch.manual_seed(0)
    model = load_model("cft-tiny-vit").eval()
    sides = {"main thread": 0, f"{a.workers} workers": a.workers}
    candidates_per_s(model, records[:4], texts, boxes, 0, work / "files")         # warm-up
    rates: dict[str, list[float]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            rates[side].append(candidates_per_s(model, records, texts, boxes, sides[side], work / "files"))
    med = {s: statistics.median(v) for s, v in rates.items()}
    before, after = med["main thread"], med[f"{a.workers} workers"]
    print(f"LISM Matcher, cft-tiny-vit on the CPU ({torch.get_num_threads()} torch threads, forwards at 1), "
          f"{a.images} images of {a.size}, {a.boxes} boxes each, every third a test image")
    print(f"candidates/s, median of {a.rounds}: main thread {before:.1f}, {a.workers} DataLoader workers {after:.1f}, "
          f"ratio {after / before:.2f}")
    shutil.rmtree(work, ignore_errors=True)
    return {"main_thread": before, "workers": after, "ratio": after / before, "n_workers": a.workers}


if __name__ == "__main__":
    main()
