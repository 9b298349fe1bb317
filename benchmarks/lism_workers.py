"""LISM's matching with its images decoded in DataLoader workers against decoding in the rank's own thread.

`python -m benchmarks.lism_workers [--images 16] [--size 2048x1536] [--boxes 12] [--workers 2] [--rounds 3]`

The `lism` stage's `Matcher` (clipfinetune/data/prepare/lism.py) over one list of DOCCI-like records written here:
`--images` JPEGs of `--size` (shapes on a noisy background; by default 3 MP, as DOCCI's photographs are large),
`--boxes` segment boxes and 3-6 sentences each, every third a test image (DOCCI: 5,000 test of 14,647), whose items
of GOAL's test list are written too. The matcher is the sample world's tiny CLIP (`cft-tiny-vit`, random weights:
the scores do not matter, the time does) on the CPU, its forwards at one thread as the stage runs them. `workers 0`
decodes each image, cuts its crops and transforms them, and writes the test items, in the calling thread (what every
rank did before); `--workers N` does that in N DataLoader workers (and N writer processes) while the rank's own
process runs the forwards. Rounds alternate the order; candidates (the image + its crops) per wall second, and per
CPU second of the rank's own process: what bounds a rank once its workers have cores of their own (on a loaded
machine the wall figures show the load instead). Medians over rounds, and the ratios workers / main thread. With a
model whose forward dominates (ViT-L-14-336 on a CPU) the ratios tend to 1; on a GPU, where the forward is fast, the
decoding is what bounds a rank.
Scratch: benchmarks/_work/lism_workers/ (replaced each run).
"""
from __future__ import annotations

import argparse
import os
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
                           enumerate(rng.sample(["red", "blue", "green", "yellow", "pink", "brown"],
                                                rng.randint(3, 6)))]
        records.append(Record("docci", image_id, f"{image_id}.jpg", root, split=image_id.split("_")[0],
                              long_caption=" ".join(texts[image_id])))
    return records, texts, boxes


def candidates_per_s(model, records, texts, boxes, workers: int, files_dir, batch_size: int = 64) -> tuple:
    """(candidates per wall second, candidates per CPU second of this process: the rank's own process, whose CPU
    time is what bounds it once the workers have cores of their own)."""
    from clipfinetune.data.prepare.lism import Matcher

    shutil.rmtree(files_dir, ignore_errors=True)
    matcher = Matcher(model, texts, boxes, batch_size, files_dir, workers=workers)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in matcher([records[i:i + 4] for i in range(0, len(records), 4)]):       # the stage's CPU unit: 4 images
        pass
    n = matcher.counts["candidates"]
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--size", default="2048x1536", help="width x height of each image")
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
    rates: dict[str, list[tuple]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            rates[side].append(candidates_per_s(model, records, texts, boxes, sides[side], work / "files"))
    wall = {s: statistics.median(w for w, _ in v) for s, v in rates.items()}
    cpu = {s: statistics.median(c for _, c in v) for s, v in rates.items()}
    before, after = list(sides)
    print(f"LISM Matcher, cft-tiny-vit on the CPU ({torch.get_num_threads()} torch threads, forwards at 1), "
          f"{a.images} images of {a.size}, {a.boxes} boxes each, every third a test image; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"candidates per wall second, median of {a.rounds}: {before} {wall[before]:.1f}, {after} {wall[after]:.1f}, "
          f"ratio {wall[after] / wall[before]:.2f}")
    print(f"candidates per CPU second of the rank's process: {before} {cpu[before]:.1f}, {after} {cpu[after]:.1f}, "
          f"ratio {cpu[after] / cpu[before]:.2f} (the bound on free cores)")
    shutil.rmtree(work, ignore_errors=True)
    return {"wall": wall, "cpu": cpu, "wall_ratio": wall[after] / wall[before], "cpu_ratio": cpu[after] / cpu[before],
            "n_workers": a.workers}


if __name__ == "__main__":
    main()
