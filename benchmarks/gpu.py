"""`python -m benchmarks --gpu`: every method's training step on one CUDA GPU (issue 32's baseline table).

ViT-B-16 (random init, full depth) at 224 px, bf16 autocast, batch 128; each method's own batch built by its
`make_example` from the sample world's shards (data/shards: run `dvc repro shards` first), moved to the GPU once;
`Trainer.train_step` (forward, loss, backward, clip, fused AdamW, clamp, after_step) timed with CUDA events after
warm-up steps, median of `STEPS`. FLOPs: `FlopCounterMode` around one `compute_gradients` (fig2's `count_flops`).
The card's rate: a bf16 8192^3 GEMM timed on the same card; a method's share = achieved TFLOP/s / the GEMM's.
Without CUDA it says so and exits 0 (the CPU figures are `python -m benchmarks`).

Then the rows beyond the step table (`extra_rows`), over real-size webdataset shards written here (640 x 480
JPEGs with COCO-length captions, fig5_real's samples; `WORKERS` loader workers on both sides):
- end to end: our `Trainer.fit` (ShardLoader) against `open_clip_train` (its `main`, through
  clipfinetune.data.open_clip_compat for the local-dir model), each a separate process, plain CLIP, bf16
  (open_clip's `amp_bf16`), the same batch and steps; median per-step samples/s after warm-up (figure 1's rule);
- the loader alone (ShardLoader, one epoch, samples/s) against the step's consumption (`Trainer.train_step` on a
  fixed batch of the same size, CUDA-synchronised);
- eval: images/s of stage eval@'s image path (`eval.sharded.encode_units`: JPEG decode and resize in `WORKERS`
  DataLoader workers, uint8 pixels normalised on the GPU, fp32 forward) over the same JPEGs;
- SAM: s/image of segment-anything `vit_b` (random init) through the `segments` stage's segmenter (`build_sam`,
  `SamAutomaticMaskGenerator`, 32 x 32 points) on 1024 x 768 images (fig5_real's function, on the device);
- LISM: crops/s of the `lism` stage's `Matcher` (images decoded and crops cut in DataLoader workers, each image and
  its box crops embedded, the sentences matched; on a GPU the crops of a unit's images share batches).
Measured on one H200: benchmarks/README.md, "Measured on a GPU". tests/scale/test_gpu_rows.py runs every row's
code on the CPU at a tiny size (not timed).
"""
from __future__ import annotations

import statistics
import time

BATCH, WARMUP, STEPS, GEMM_N = 128, 3, 10, 8192
# extra_rows' sizes: on the GPU (ViT-B-16) and the CPU test's tiny ones (tests/scale/test_gpu_rows.py)
SIZES = {
    "gpu": {"batch": BATCH, "workers": 6, "steps": 30, "skip": 5, "eval_images": 512, "sam_images": 3,
            "sam_size": (1024, 768), "sam_points": 32, "lism_images": 64, "lism_boxes": 12},
    "tiny": {"batch": 4, "workers": 1, "steps": 3, "skip": 1, "eval_images": 8, "sam_images": 1,
             "sam_size": (256, 192), "sam_points": 2, "lism_images": 3, "lism_boxes": 3},
}


def cuda_ms(fn, reps: int) -> list[float]:
    import torch

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def gemm_tflops(n: int = GEMM_N, reps: int = 20) -> float:
    import torch

    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cuda_ms(lambda: a @ b, 3)
    return 2 * n ** 3 / (statistics.median(cuda_ms(lambda: a @ b, reps)) / 1e3) / 1e12


def method_step(name: str, model_dir, params: dict, log, *, device: str = "cuda:0", batch: int = BATCH,
                precision: str = "bf16", warmup: int = WARMUP, steps: int = STEPS, samples=None,
                compile_model: bool = False, backend: str = "inductor") -> dict:
    """One method's `Trainer.train_step` on a fixed batch of `batch` built from `samples` (default: the sample
    shards), timed with CUDA events on a GPU (wall clock on the CPU), and its FLOPs (fig2's `count_flops`, on the
    eager module). `compile_model`: the Trainer's `compile: true` (torch.compile of the model's forward and backward,
    `backend`); the warm-up steps, compilation included, are timed as one wall-clock figure (`warmup_s`)."""
    import torch

    from clipfinetune.data.loader import ExampleContext
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import DistInfo, TrainConfig, Trainer, loop

    from .fig2_methods import FixedSource, count_flops, make_batch, method_config, shard_samples

    device = torch.device(device)
    model = load_model("local-dir:" + str(model_dir), device=device)
    method = build_method(name, **method_config(name, params))
    ctx = ExampleContext.of_model(model)
    cfg = TrainConfig(epochs=1, batch_size=batch, lr=1e-5, wd=0.1, grad_clip=1.0, precision=precision,
                      compile=compile_model)
    default_backend, loop.COMPILE_BACKEND = loop.COMPILE_BACKEND, backend     # read when the Trainer is built
    try:
        trainer = Trainer(method, model, FixedSource(None), cfg, dist=DistInfo(device=device), desc=f"gpu-{name}")
    finally:
        loop.COMPILE_BACKEND = default_backend
    examples = trainer._to_device(make_batch(method, ctx, samples if samples is not None else shard_samples(), batch))
    trainer.module.train()
    compiled, trainer.ddp = trainer.ddp, getattr(trainer.ddp, "_orig_mod", trainer.ddp)  # FLOPs of the eager graph
    flops = count_flops(trainer, examples)
    trainer.ddp = compiled
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if compile_model:
        torch._dynamo.reset()      # each method's module is new: no earlier method's graphs, no recompile limit hit
    timer = (lambda fn, n: cuda_ms(fn, n)) if cuda else wall_ms
    t0 = time.perf_counter()
    for _ in range(warmup):
        trainer.train_step([examples])
    synchronize(device)
    warmup_s = time.perf_counter() - t0
    ms = statistics.median(timer(lambda: trainer.train_step([examples]), steps))
    row = {"method": name, "ms_per_step": ms, "samples_per_s": batch / ms * 1e3,
           "tflops": flops / (ms / 1e3) / 1e12, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
           "device": str(device), "batch": batch, "precision": precision, "compiled": compile_model,
           "warmup_s": warmup_s, "warmup_steps": warmup}
    log(f"  gpu {name}{' compiled' if compile_model else ''} batch {batch}: {ms:.1f} ms/step, "
        f"{row['tflops']:.2f} TFLOP/s, warm-up {warmup_s:.1f} s")
    return row                                  # the trainer is freed on return; main() empties the cache


def compile_pays_after(eager: dict, compiled: dict) -> float:
    """Optimiser steps after which the compiled run has caught up with the eager one, its warm-up (compilation)
    counted: the warm-up's extra seconds over the seconds each step saves (inf when it saves none)."""
    extra_s = compiled["warmup_s"] - eager["warmup_s"]
    saved_s = (eager["ms_per_step"] - compiled["ms_per_step"]) / 1e3
    return max(0.0, extra_s) / saved_s if saved_s > 0 else float("inf")


def wall_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def synchronize(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def end_to_end(model_dir, shards, size: dict, device: str, precision: str, log=print) -> dict:
    """Our Trainer.fit vs open_clip_train, separate processes over the same shards (figure 1's runners)."""
    from . import fig1_openclip as fig1

    batch, workers, steps, skip = size["batch"], size["workers"], size["steps"], size["skip"]
    ours = fig1.run_ours(model_dir, batch, workers, shards=shards, max_steps=steps, skip=skip, device=device,
                         precision=precision)
    theirs = fig1.run_openclip(model_dir, batch, workers, batch * steps, 0, shards=shards, skip=skip,
                               device=device, precision=precision)
    row = {"ours_samples_per_s": ours["median_sps"], "open_clip_train_samples_per_s": theirs["median_sps"],
           "ratio": ours["median_sps"] / theirs["median_sps"], "ours": ours, "open_clip_train": theirs}
    log(f"  gpu end to end: ours {row['ours_samples_per_s']:.0f}, open_clip_train "
        f"{row['open_clip_train_samples_per_s']:.0f} samples/s ({row['ratio']:.2f}x)")
    return row


def loader_vs_step(model_dir, shards, size: dict, device: str, precision: str, log=print) -> dict:
    """ShardLoader's samples/s over one epoch of the shards vs what `Trainer.train_step` consumes."""
    import torch

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import DistInfo, TrainConfig, Trainer

    from .fig2_methods import FixedSource

    batch_size, workers = size["batch"], size["workers"]
    model = load_model("local-dir:" + str(model_dir), device=device)
    method = build_method("clip")
    ctx = ExampleContext.of_model(model)
    loader = ShardLoader(shards, "train", method, ctx, batch_size=batch_size, seed=0, num_workers=workers,
                         pin_memory=torch.device(device).type == "cuda")          # as stage train@ on a GPU
    it = iter(loader.batches(0))
    batch = next(it)                            # worker start-up and the first batch not counted
    t0, n = time.perf_counter(), 0
    for b in it:
        n += b["image"].shape[0]
    loader_sps = n / (time.perf_counter() - t0) if n else float("nan")
    del it, loader
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=1e-5, wd=0.1, grad_clip=1.0, precision=precision)
    trainer = Trainer(method, model, FixedSource(None), cfg, dist=DistInfo(device=torch.device(device)))
    batch = trainer._to_device(batch)
    trainer.module.train()
    trainer.train_step([batch])
    synchronize(device)
    times = []
    for _ in range(size["steps"]):
        t0 = time.perf_counter()
        trainer.train_step([batch])
        synchronize(device)
        times.append(time.perf_counter() - t0)
    step_sps = batch_size / statistics.median(times)
    log(f"  gpu loader: {loader_sps:.0f} samples/s ({workers} workers) vs the step's {step_sps:.0f}")
    return {"loader_samples_per_s": loader_sps, "step_samples_per_s": step_sps, "ratio": loader_sps / step_sps,
            "loader_samples": n, "workers": workers}


def eval_images_per_s(model_dir, image_paths, size: dict, device: str, log=print) -> dict:
    """Stage eval@'s image path: `eval.sharded.encode_units` over image units of `size["batch"]` (the "shortest"
    resize of retrieval, zero-shot and compositionality), decoded in `size["workers"]` DataLoader workers, uint8
    pixels pinned and normalised on `device`, fp32 forwards (the evaluation never autocasts)."""
    from clipfinetune.eval.encode import Encoder
    from clipfinetune.eval.sharded import encode_units
    from clipfinetune.models import load_model

    encoders = {"model": Encoder(load_model("local-dir:" + str(model_dir), device=device).eval(),
                                 batch_size=size["batch"])}

    def units(paths):
        return [{"kind": "images", "model": "model", "resize": "shortest",
                 "keys": [[p, None] for p in paths[s:s + size["batch"]]]} for s in range(0, len(paths), size["batch"])]

    list(encode_units(units(image_paths[:1]), encoders, size["workers"]))          # warm-up: kernels, allocator
    timed = units(image_paths[1:])
    t0 = time.perf_counter()
    out = [res["emb"] for _, res in encode_units(timed, encoders, size["workers"])]
    synchronize(device)
    n = sum(len(unit["keys"]) for unit in timed)
    rate = n / (time.perf_counter() - t0)
    log(f"  gpu eval: {rate:.0f} images/s (encode_units, {size['workers']} workers)")
    return {"images_per_s": rate, "images": n, "embedding_dim": int(out[0].shape[1]), "workers": size["workers"],
            "path": "eval.sharded.encode_units"}


def sam_seconds(size: dict, device: str, log=print) -> dict:
    from .fig5_real import sam_seconds_per_image

    out = sam_seconds_per_image(size["sam_images"], size["sam_size"], device, size["sam_points"])
    out["median_seconds_per_image"] = statistics.median(out["seconds_per_image"])
    log(f"  gpu SAM vit_b: {out['median_seconds_per_image']:.2f} s/image")
    return out


def lism_crops_per_s(model_dir, samples, work, size: dict, device: str, log=print) -> dict:
    """The `lism` stage's `Matcher` over `lism_images` JPEGs (files, as the stage reads them) with `lism_boxes` boxes
    each and their captions as sentences: images decoded and crops cut in `workers` DataLoader workers, the
    candidates of a unit's images in shared batches on a GPU (the stage's unit: 64 images on cuda, 4 on the CPU).
    Candidates (image + crops) per second after a warm-up unit."""
    import random

    from clipfinetune.data.prepare.lism import Matcher
    from clipfinetune.data.readers import Record
    from clipfinetune.models import load_model

    model = load_model("local-dir:" + str(model_dir), device=device).eval()
    folder = work / "lism_images"
    folder.mkdir(parents=True, exist_ok=True)
    rng, records, texts, boxes = random.Random(0), [], {}, {}
    for key, jpg, record in samples[:size["lism_images"] + 1]:
        (folder / f"{key}.jpg").write_bytes(jpg)
        records.append(Record("bench", key, f"{key}.jpg", folder, split="train"))
        texts[key], boxes[key] = list(record["captions"]), []
        for _ in range(size["lism_boxes"]):
            x, y = rng.uniform(0, 320), rng.uniform(0, 240)
            boxes[key].append((x, y, x + rng.uniform(80, 320), y + rng.uniform(60, 240)))
    unit = 64 if device.startswith("cuda") else 4
    matcher = Matcher(model, texts, boxes, size["batch"], work / "lism_files", workers=size["workers"])
    list(matcher([records[:1]]))                                  # warm-up (not counted below)
    timed = records[1:]
    matcher.counts = dict.fromkeys(matcher.counts, 0)
    t0 = time.perf_counter()
    results = [r for part in matcher([timed[i:i + unit] for i in range(0, len(timed), unit)]) for r in part]
    synchronize(device)
    seconds = time.perf_counter() - t0
    crops = matcher.counts["candidates"]
    log(f"  gpu LISM: {crops / seconds:.0f} crops/s")
    return {"crops_per_s": crops / seconds, "crops": crops, "images": len(timed),
            "matched": sum("matches" in r for r in results), "workers": size["workers"]}


def row_inputs(work, size: dict) -> tuple[list, object, list[str]]:
    """The rows' inputs under `work`: (real-size samples, shards of the first batch x (steps + 2) of them, the eval
    rows' image files)."""
    from .fig5_real import real_samples, write_shards

    n = size["batch"] * (size["steps"] + 2)
    samples = real_samples(max(n, size["eval_images"] + 1, size["lism_images"] + 1))
    shards = write_shards(samples[:n], work / "shards", n_shards=max(size["workers"], 1))
    images = work / "images"
    images.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, jpg, _ in samples[:size["eval_images"] + 1]:
        (images / f"{key}.jpg").write_bytes(jpg)
        paths.append(str(images / f"{key}.jpg"))
    return samples, shards, paths


def extra_rows(model_dir, work, size: dict, device: str, precision: str, log=print) -> dict:
    """Every row beyond the step table, over real-size shards written under `work`."""
    samples, shards, paths = row_inputs(work, size)
    return {"end_to_end": end_to_end(model_dir, shards, size, device, precision, log),
            "loader": loader_vs_step(model_dir, shards, size, device, precision, log),
            "eval": eval_images_per_s(model_dir, paths, size, device, log),
            "sam": sam_seconds(size, device, log),
            "lism": lism_crops_per_s(model_dir, samples, work, size, device, log)}


def print_extra(extra: dict) -> None:
    e2e, loader = extra["end_to_end"], extra["loader"]
    print("| row | ours | reference | ratio | target |")
    print("|---|---|---|---|---|")
    print(f"| end to end, samples/s (vs open_clip_train) | {e2e['ours_samples_per_s']:.0f} | "
          f"{e2e['open_clip_train_samples_per_s']:.0f} | {e2e['ratio']:.2f}x | >= 1.0x (aim 1.2x) |")
    print(f"| loader vs step, samples/s | {loader['loader_samples_per_s']:.0f} | {loader['step_samples_per_s']:.0f} "
          f"| {loader['ratio']:.2f}x | >= 1.1x |")
    print(f"| eval, images/s | {extra['eval']['images_per_s']:.0f} | | | |")
    print(f"| SAM vit_b, s/image | {extra['sam']['median_seconds_per_image']:.2f} | | | |")
    print(f"| LISM, crops/s | {extra['lism']['crops_per_s']:.0f} | | | |")


def main(log=print) -> int:
    import torch

    if not torch.cuda.is_available():
        print("python -m benchmarks --gpu: no CUDA device visible to torch (torch.cuda.is_available() is False); "
              "nothing measured")
        return 0
    from .common import SHARDS, load_params
    from .fig2_methods import METHODS
    from .fig5_real import real_model_dir

    if not any(SHARDS.glob("train-*.tar")):
        raise SystemExit(f"--gpu builds each method's batch from the sample shards: none in {SHARDS} "
                         "(run `dvc repro shards` first)")
    params, model_dir = load_params(), real_model_dir()
    peak = gemm_tflops()
    rows = []
    for name in METHODS:
        rows.append(method_step(name, model_dir, params, log))
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name(0)}: bf16 {GEMM_N}^3 GEMM {peak:.0f} TFLOP/s; ViT-B-16 224 px bf16, "
          f"batch {BATCH}, Trainer.train_step")
    print("| method | ms/step | samples/s | achieved TFLOP/s | share of the GEMM's rate | peak GB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['ms_per_step']:.1f} | {r['samples_per_s']:.0f} | {r['tflops']:.0f} | "
              f"{r['tflops'] / peak:.0%} | {r['peak_gb']:.1f} |")
    from .common import WORK

    record_steps(torch.cuda.get_device_name(0), rows)
    extra = extra_rows(model_dir, WORK / "gpu_rows", SIZES["gpu"], "cuda", "bf16", log)
    print(f"ViT-B-16 bf16, batch {BATCH}, {SIZES['gpu']['workers']} loader workers, 640 x 480 JPEG shards")
    print_extra(extra)
    record_extra(torch.cuda.get_device_name(0), extra)
    return 0


def step_figures(device: str, rows: list[dict], command: str) -> list[dict]:
    """Step rows as calibration figures (benchmarks/calibration.py's schema, plus `batch`): `train_step` for the
    eager step, `train_step_compiled` for `compile: true` (its warm-up in `source`), per GPU (process on the CPU)."""
    from .calibration import source

    src = source(command)
    return [{"device": device, "what": "train_step_compiled" if r.get("compiled") else "train_step",
             "arch": r.get("arch", "ViT-B-16"), "method": r["method"], "batch": r["batch"],
             "value": round(r["samples_per_s"], 1), "unit": "samples/s",
             "per": "GPU" if device != "cpu" else "process",
             "settings": f"Trainer.train_step, 224 px, {r['precision']} autocast, batch {r['batch']}, random init"
                         + (", torch.compile of the model" if r.get("compiled") else "") + "; no loader",
             "source": f"{src}: {r['ms_per_step']:.1f} ms/step, {r['warmup_s']:.1f} s for "
                       f"{r['warmup_steps']} warm-up steps" + (" (compilation included)" if r.get("compiled") else "")}
            for r in rows]


def record_steps(device: str, rows: list[dict]) -> None:
    """The step table into benchmarks/calibration.json (the rates `clipfinetune plan` estimates training with)."""
    from .calibration import record

    record(step_figures(device, rows, "python -m benchmarks --gpu"))


def record_extra(device: str, extra: dict) -> None:
    from .calibration import record, source

    src, size = source("python -m benchmarks --gpu"), SIZES["gpu"]
    w, h = size["sam_size"]
    record([{"device": device, "what": "segments", "arch": "sam_vit_b", "method": "",
             "value": round(extra["sam"]["median_seconds_per_image"], 3), "unit": "s/image", "per": "GPU",
             "settings": f"segments' segmenter, {size['sam_points']} x {size['sam_points']} points, {w} x {h} images",
             "source": src},
            {"device": device, "what": "eval_images", "arch": "ViT-B-16", "method": "",
             "value": round(extra["eval"]["images_per_s"], 1), "unit": "images/s", "per": "GPU",
             "settings": "Encoder.images: JPEG decode, transform, fp32 forward", "source": src},
            {"device": device, "what": "lism_crops", "arch": "ViT-B-16", "method": "",
             "value": round(extra["lism"]["crops_per_s"], 1), "unit": "crops/s", "per": "GPU",
             "settings": f"match_images, {size['lism_boxes']} boxes per image", "source": src}])
