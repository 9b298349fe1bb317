"""Figure 5: the real size (issue 25). Random weights (step times do not depend on them), CPU, fp32.

- ViT-B-16 at 224 px (full depth, 12 + 12 blocks), batch 8: our plain-CLIP `Trainer` vs `open_clip_train`, each a
  separate process over the same webdataset shards of real-size images (640 x 480 JPEGs with COCO-length captions,
  written here), 2 loader workers, per-step samples/s after warm-up as in figure 1; then figure 1's in-process
  breakdown on one fixed batch: ours, ours with text trimming off, and an open_clip-style step. Trimming runs the
  text tower up to the batch's longest caption instead of 77 positions: at real size the image tower (197 tokens
  x 768 wide) dominates the step, so trimming gains less than on the tiny model (figure 1).
- SAM `vit_b` (random init, loaded from a checkpoint file by `clipfinetune.data.prepare.segments.build_sam`) through
  `SamAutomaticMaskGenerator` at the `segments` stage's settings (32 x 32 points, thresholds 0.88 / 0.95), masks ->
  boxes at 1%..80%: seconds per 1024 x 768 image.
"""
from __future__ import annotations

import io
import json
import random
import time

from .common import WORK, Row, median, shell

BATCH = 8
STEPS = 8                  # optimiser steps per process run
SKIP = 2                   # warm-up steps dropped
WORDS = (["red", "blue", "green", "yellow", "small", "large"], ["circle", "square", "triangle", "star", "ring"],
         ["above", "below", "beside", "left of", "right of"])


def real_model_dir():
    """A random-init full ViT-B-16 exported as our pipeline exports models (cached under benchmarks/_work)."""
    from clipfinetune.models import export_model, load_model

    folder = WORK / "model_vit_b16"
    if not (folder / "open_clip_config.json").is_file():
        export_model(load_model("ViT-B-16"), folder)
    return folder


def caption(rng: random.Random) -> str:
    colour, shape, relation = WORDS
    a, b = (f"a {rng.choice(colour)} {rng.choice(shape)}" for _ in range(2))
    return f"{a} {rng.choice(relation)} {b} on a grey table in a bright room"          # ~16 tokens, COCO-like


def real_samples(n: int, size=(640, 480)) -> list[tuple[str, bytes, dict]]:
    """(key, jpg bytes, shard record) of `n` real-size images with shapes and five captions each."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    out = []
    for i in range(n):
        image = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x, y = rng.randrange(size[0] - 100), rng.randrange(size[1] - 100)
            draw.ellipse([x, y, x + rng.randrange(40, 200), y + rng.randrange(40, 200)],
                         fill=tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        captions = [caption(rng) for _ in range(5)]
        record = {"image_id": str(i), "source": "coco", "width": size[0], "height": size[1], "captions": captions,
                  "long_caption": "", "word_regions": [], "sentences": [], "local_pair": [], "negatives": []}
        out.append((f"coco_{i}", buf.getvalue(), record))
    return out


def write_shards(samples, folder, n_shards: int = 2):
    """The shard layout of DEVELOPERS.md (jpg, txt = first caption, json) and its index; one shard per loader worker."""
    import webdataset as wds

    from clipfinetune.data.prepare.shards import write_index

    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(n_shards):
        with wds.TarWriter(str(folder / f"train-{shard:06d}.tar")) as sink:
            for key, jpg, record in samples[shard::n_shards]:
                sink.write({"__key__": key, "jpg": jpg, "txt": record["captions"][0], "json": json.dumps(record)})
    write_index(folder)
    return folder


def sam_seconds_per_image(n_images: int = 2, size=(1024, 768), device: str = "cpu", points_per_side: int = 32) -> dict:
    import numpy as np
    import torch
    from segment_anything import sam_model_registry

    from clipfinetune.data.prepare.segments import build_sam, sam_masks_fn, segment_image

    torch.manual_seed(0)
    checkpoint = WORK / "sam_vit_b_random.pth"
    torch.save(sam_model_registry["vit_b"]().state_dict(), checkpoint)
    generated = []

    def counting(fn):
        def masks(image):
            out = fn(image)
            generated.append(len(out))
            return out
        return masks

    masks_fn = counting(sam_masks_fn(build_sam("vit_b", str(checkpoint), device), points_per_side=points_per_side,
                                     pred_iou_thresh=0.88, stability_score_thresh=0.95))
    from PIL import Image

    times, kept = [], []
    for i, (_, jpg, _) in enumerate(real_samples(n_images, size)):
        image = np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB"))
        t0 = time.perf_counter()
        kept.append(len(segment_image(image, masks_fn, 0.01, 0.8)))
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"seconds_per_image": times, "masks_generated": generated, "segments_kept_1_80pct": kept,
            "image_size": list(size), "threads": torch.get_num_threads(), "device": device,
            "points_per_side": points_per_side}


def figure(*, pairs: int = 2, log=print) -> list[Row]:
    from . import fig1_openclip as fig1

    model_dir = real_model_dir()
    samples = real_samples(BATCH * (STEPS + 2))
    shards = write_shards(samples, WORK / "real_shards")
    n_samples = BATCH * STEPS
    ours_runs, oc_runs = [], []
    for i in range(pairs):        # alternating order: on a shared machine the load drifts within a pair
        def ours():
            return fig1.run_ours(model_dir, BATCH, 2, shards=shards, max_steps=STEPS, skip=SKIP)

        def theirs(i=i):
            return fig1.run_openclip(model_dir, BATCH, 2, n_samples, i, shards=shards, skip=SKIP)

        if i % 2 == 0:
            a, b = ours(), theirs()
        else:
            b, a = theirs(), ours()
        log(f"  fig5 pair {i}: ours {a['median_sps']:.2f}, open_clip_train {b['median_sps']:.2f} samples/s "
            f"({a['timed_steps']}/{b['timed_steps']} timed steps, {'ours' if i % 2 == 0 else 'theirs'} first)")
        ours_runs.append(a)
        oc_runs.append(b)
    ratio = median([a["median_sps"] / b["median_sps"] for a, b in zip(ours_runs, oc_runs)])
    log("  fig5 compute-only breakdown at ViT-B-16 (in process, fixed batch)...")
    breakdown = fig1.compute_only(model_dir, BATCH, reps=1, steps=3, samples=samples)
    trim_gain = breakdown["ours"] / breakdown["ours_untrimmed"]
    log(f"  fig5 compute-only: {breakdown}")
    log("  fig5 SAM vit_b on 1024 x 768 images...")
    sam = sam_seconds_per_image()
    log(f"  fig5 SAM: {sam}")
    commands = [shell(fig1.ours_cmd(model_dir, BATCH, 2, shards, STEPS)),
                shell(fig1.openclip_cmd(model_dir, BATCH, 2, n_samples, "bench-<ts>-<i>", shards)),
                f"in process: benchmarks.fig1_openclip.compute_only(ViT-B-16, batch_size={BATCH}, reps=1, steps=3)",
                "in process: benchmarks.fig5_real.sam_seconds_per_image()"]
    details = {"model": "ViT-B-16 (random init, full depth), 224 px, fp32, CPU", "batch_size": BATCH,
               "steps_per_run": STEPS, "warmup_steps_dropped": SKIP, "pairs": pairs, "workers": 2,
               "ours_runs": ours_runs, "open_clip_runs": oc_runs, "compute_only_samples_per_s": breakdown}
    return [
        Row("5 ViT-B-16 b8: Trainer vs open_clip_train (samples/s)", median([a["median_sps"] for a in ours_runs]),
            median([b["median_sps"] for b in oc_runs]), ratio, "info", None, "samples/s", details, commands[:2]),
        Row("5 ViT-B-16 b8: text trimming, ours vs untrimmed (samples/s)", breakdown["ours"],
            breakdown["ours_untrimmed"], trim_gain, "info", None, "samples/s", details, commands[2:3]),
        Row("5 SAM vit_b automatic masks, 1024x768 (s/image)", median(sam["seconds_per_image"]), None, None,
            "info", None, "s/image", sam, commands[3:]),
    ]
