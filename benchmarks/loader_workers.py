"""Per-worker rates of the training loader and of the evaluation's image path on the CPU, before and after uint8 pixels.

`python -m benchmarks.loader_workers [--samples 256] [--rounds 3] [--textured]`

Inputs, written here: `--samples` 640 x 480 JPEGs with five COCO-length captions each (benchmarks/fig5_real.py's
`real_samples`, the images of the GPU acceptance run's loader row) in two webdataset shards of the project's layout
with their index (`write_shards`), and the same JPEGs as files for the evaluation. `--textured` adds noise before
the JPEG encoding so that a file weighs what a COCO photograph does (~150-200 KB instead of ~12 KB): decoding then
costs what it costs on real data.

1. Where a sample's time goes, in this process at one torch thread (as a loader worker runs): reading the record,
   decoding the JPEG, the resize, the tensor conversion, tokenising a caption, collating; each step as the loader
   ran it before (open_clip's preprocess: PIL's bicubic, float, normalised in the worker) and as it runs now
   (`ClipModel.pixel_transform`: torchvision's uint8 bicubic, uint8 through collate, normalised by the model on its
   device). The transfer to a GPU is not measured here: its bytes per sample are printed. `io.read_image` no
   longer copies an RGB image (its `convert`): that saving is in both sides of 2. and 3. (they run today's
   `read_image`), so their ratios understate the change by it; the breakdown shows it on its own line.
2. The training loader: `ShardLoader` of stage train@'s plain `clip` method with ONE DataLoader worker (224 px, the
   ViT-B-16 preprocess, batch 32), one epoch over the shards, the first batch (worker start) not counted: samples/s
   of that worker. Before: `ExampleContext.of_model(model, transform=model.transform)` (the float transform the
   loader used); after: `ExampleContext.of_model(model)`.
3. The evaluation's image path: `eval.sharded.unit_images`, the DataLoader that stage eval@'s `encode_units` reads
   (one worker, units of 32 images, the "shortest" resize of retrieval / zero-shot / compositionality and the
   "squash" of box classification), the model not run: images/s of that worker. Before: the `Encoder`'s transforms
   were `model.eval_transform(mode)`; after: `model.pixel_transform(mode)`.
Rounds alternate before and after; medians over `--rounds`, and the ratios after / before of this one run. The model
is ViT-B-16 with random weights (only its preprocess and tokenizer are used). Scratch: benchmarks/_work/loader_workers/.
"""
from __future__ import annotations

import argparse
import io
import shutil
import statistics
import time

from .common import WORK

BATCH = 32
MODEL = "ViT-B-16"


def write_inputs(folder, n: int, textured: bool):
    """(samples, shards folder, image paths) under `folder`: `n` 640 x 480 JPEG samples in two shards + as files."""
    from .fig5_real import real_samples, write_shards

    samples = real_samples(n)
    if textured:
        samples = [(key, add_texture(jpg, i), record) for i, (key, jpg, record) in enumerate(samples)]
    shards = write_shards(samples, folder / "shards", n_shards=2)
    images = folder / "images"
    images.mkdir(parents=True)
    paths = []
    for key, jpg, _ in samples:
        (images / f"{key}.jpg").write_bytes(jpg)
        paths.append(str(images / f"{key}.jpg"))
    return samples, shards, paths


def add_texture(jpg: bytes, seed: int) -> bytes:
    """The image with Gaussian noise (sigma 18 grey levels), re-encoded at quality 90: a photograph's file size."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(jpg)).convert("RGB")).astype(np.int16)
    noisy = pixels + np.random.default_rng(seed).normal(0, 18, pixels.shape).astype(np.int16)
    out = io.BytesIO()
    Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def preprocess_model():
    """A `ClipModel` with ViT-B-16's preprocess (224 px, OpenAI mean/std, bicubic) and CLIP's tokenizer: the sample
    world's tiny tower at 224 px (building ViT-B-16's random weights would cost more CPU than the measurement)."""
    import open_clip

    from clipfinetune.models import ClipModel, register_bundled_configs

    register_bundled_configs()
    clip = open_clip.create_model("cft-tiny-vit", force_image_size=224)
    model = ClipModel(clip, open_clip.get_model_config("cft-tiny-vit"), tokenizer_source="").eval()
    reference = open_clip.get_model_preprocess_cfg(open_clip.create_model(MODEL, pretrained=None, device="meta"))
    cfg = model.preprocess_cfg
    assert (cfg["size"], cfg["mean"], cfg["std"], cfg["interpolation"]) == (
        list(reference["size"]), list(reference["mean"]), list(reference["std"]), reference["interpolation"]), cfg
    return model


# ------------------------------------------------------------------------------------------ 1. the breakdown
def per_sample_ms(fn, items, reps: int = 3) -> float:
    """CPU ms of this process per item (process time: what the step costs, not what the machine's load adds)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.process_time()
        for item in items:
            fn(item)
        best = min(best, (time.process_time() - t0) / len(items))
    return best * 1e3


def breakdown(model, samples, shards) -> list[tuple[str, float | None, float | None]]:
    """(step, ms per sample before, ms per sample after) of one sample's way through a loader worker; None: the
    step is the same on both sides (before) or not taken (after)."""
    from torch.utils.data import default_collate
    from torchvision.transforms import v2

    from clipfinetune.data.loader import UnitTable
    from clipfinetune.io import read_image
    from clipfinetune.methods import build_method

    items = samples[:64]
    units = UnitTable(shards, "train", build_method("clip"), per_unit=False)
    images = [read_image(jpg) for _, jpg, _ in items]
    captions = [record["captions"][0] for _, _, record in items]
    before_resize, after_resize = model.transform.transforms[0], model.pixel_transform().transforms[-1]
    to_uint8 = v2.PILToTensor()
    resized_pil = [before_resize(im) for im in images]
    resized_before = [model.transform.transforms[-1](model.transform.transforms[-2](im)) for im in resized_pil]
    resized_after = [after_resize(to_uint8(im)) for im in images]
    tokens = [model.tokenize([c])[0] for c in captions]

    def draft_decode(jpg):
        from PIL import Image

        im = Image.open(io.BytesIO(jpg))
        im.draft("RGB", (224, 224))
        return im.convert("RGB")

    def collate(pixels):
        examples = [{"image": x, "text": t} for x, t in zip(pixels, tokens)]
        return lambda _: default_collate(examples)

    rows = [("read the record (pread, json)", per_sample_ms(units.read, range(len(items))), None),
            ("decode (io.read_image, PIL)", per_sample_ms(lambda s: read_image(s[1]), items), None),
            ("copy of the RGB image (read_image's convert, now skipped)",
             per_sample_ms(lambda im: im.convert("RGB"), images), 0.0),
            ("resize 640x480 -> 224 (PIL bicubic | torchvision uint8 bicubic)",
             per_sample_ms(before_resize, images), per_sample_ms(lambda im: after_resize(to_uint8(im)), images)),
            ("to tensor (float + normalise | uint8, in the resize above)",
             per_sample_ms(lambda im: model.transform.transforms[-1](model.transform.transforms[-2](im)),
                           resized_pil), 0.0),
            ("tokenise one caption", per_sample_ms(lambda c: model.tokenize([c])[0], captions), None),
            ("collate, per sample (float32 | uint8)",
             per_sample_ms(collate(resized_before), [0], reps=5) / len(items),
             per_sample_ms(collate(resized_after), [0], reps=5) / len(items))]
    rows.append(("(not used) decode at 1/2 scale (PIL draft), for comparison", None,
                 per_sample_ms(lambda s: draft_decode(s[1]), items)))
    return rows


# ------------------------------------------------------------------------------------------ 2. and 3. one worker
class WorkerClock:
    """CPU seconds of the DataLoader workers started after it was made (children of this process): a worker's rate
    per CPU second is what it delivers with a core of its own, whatever else the machine runs."""

    def __init__(self):
        import psutil

        self.me = psutil.Process()
        self.before = {p.pid for p in self.me.children()}
        self.workers, self.seconds = {}, 0.0

    def read(self) -> float:
        """The new workers' CPU seconds so far (kept from their last reading once they have exited)."""
        import psutil

        for p in self.me.children():
            if p.pid not in self.before:
                self.workers.setdefault(p.pid, p)
        total = 0.0
        for pid, p in self.workers.items():
            try:
                times = p.cpu_times()
                self.last = getattr(self, "last", {})
                self.last[pid] = times.user + times.system
            except psutil.NoSuchProcess:
                pass
            total += getattr(self, "last", {}).get(pid, 0.0)
        return total


def rates(batches, clock: WorkerClock) -> tuple[float, float]:
    """(items per wall second after the first batch, items per worker CPU second over all batches); every batch's
    first dimension counts its items. The workers' lazy resources are loaded in this process before (tokenizer)."""
    first = next(batches)
    clock.read()
    n, t0 = 0, time.perf_counter()
    for batch in batches:
        n += batch.shape[0]
        cpu = clock.read()
    wall = n / (time.perf_counter() - t0)
    return wall, (n + first.shape[0]) / cpu


def loader_rates(model, shards, after: bool) -> tuple[float, float]:
    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import build_method

    ctx = ExampleContext.of_model(model) if after else ExampleContext.of_model(model, transform=model.transform)
    clock = WorkerClock()
    loader = ShardLoader(shards, "train", build_method("clip"), ctx, batch_size=BATCH, seed=0, num_workers=1)
    return rates((b["image"] for b in loader.batches(0)), clock)


class TodaysEvalTransforms:
    """The model as the evaluation's `Encoder` saw it before: its image transforms were open_clip's float
    preprocess (`eval_transform(mode)`), which this stand-in hands out as `pixel_transform`."""

    def __init__(self, model):
        self.model = model

    def pixel_transform(self, resize_mode: str = "squash"):
        return self.model.eval_transform(resize_mode)


def eval_rates(model, paths, resize_mode: str, after: bool) -> tuple[float, float]:
    from clipfinetune.eval.encode import Encoder
    from clipfinetune.eval.sharded import unit_images

    units = [{"kind": "images", "model": "model", "resize": resize_mode,
              "keys": [[p, None] for p in paths[s:s + BATCH]]} for s in range(0, len(paths), BATCH)]
    encoder = Encoder(model if after else TodaysEvalTransforms(model), BATCH)
    clock = WorkerClock()
    return rates((x for x, _ in unit_images(units, {"model": encoder}, workers=1)), clock)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--textured", action="store_true", help="noisy JPEGs of a photograph's size")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)                                  # a loader worker's torch threads
    work = WORK / "loader_workers"
    shutil.rmtree(work, ignore_errors=True)
    samples, shards, paths = write_inputs(work, args.samples, args.textured)
    size = statistics.mean(len(jpg) for _, jpg, _ in samples) / 1024
    model = preprocess_model()
    print(f"{args.samples} 640 x 480 JPEGs ({size:.0f} KB each on average{', textured' if args.textured else ''}), "
          f"{MODEL} preprocess (224 px, bicubic)")

    print("\nwhere a sample's time goes (ms per sample, one thread):")
    print("| step | before | after |\n|---|---|---|")
    total = {"before": 0.0, "after": 0.0}
    for step, before, after in breakdown(model, samples, shards):
        if step.startswith("(not used)"):
            print(f"| {step} | | {after:.3f} |")
            continue
        after = before if after is None else after
        total["before"] += before
        total["after"] += after
        print(f"| {step} | {before:.3f} | {after:.3f} |")
    print(f"| sum | {total['before']:.3f} | {total['after']:.3f} |")
    print(f"transfer to a GPU (not measured without one): {3 * 224 * 224 * 4:,} bytes per sample as float32 "
          f"before, {3 * 224 * 224:,} as uint8 after, from pinned memory on a CUDA trainer")

    model.tokenize(["warm"])                                  # the tokenizer cached before the workers fork
    measured = {key: [] for key in ("loader", "eval shortest", "eval squash")}
    for r in range(args.rounds):
        for after in ((False, True) if r % 2 == 0 else (True, False)):
            measured["loader"].append((after, loader_rates(model, shards, after)))
            measured["eval shortest"].append((after, eval_rates(model, paths, "shortest", after)))
            measured["eval squash"].append((after, eval_rates(model, paths, "squash", after)))
    print(f"\none DataLoader worker, medians of {args.rounds} rounds; per worker CPU second (per wall second: what "
          f"this machine's load left it)")
    print("| path | before /s | after /s | after / before | wall: before, after /s |\n|---|---|---|---|---|")
    names = {"loader": "training loader (ShardLoader, clip, samples)",
             "eval shortest": "eval images, shortest resize (unit_images)",
             "eval squash": "eval images, squash resize (unit_images)"}
    for key, runs in measured.items():
        (wall_b, cpu_b), (wall_a, cpu_a) = ([statistics.median(v[i] for a, v in runs if a == side) for i in (0, 1)]
                                            for side in (False, True))
        print(f"| {names[key]} | {cpu_b:.0f} | {cpu_a:.0f} | {cpu_a / cpu_b:.2f}x | {wall_b:.0f}, {wall_a:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
