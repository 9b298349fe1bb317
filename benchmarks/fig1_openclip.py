"""Figure 1: our plain-CLIP `Trainer` vs `open_clip_train` (same model, fp32, CPU, batch size, shards, workers).

Both sides run as separate processes, alternately (ours, theirs, ours, ...), each a full epoch over the train
shards with 2 loader workers. The throughput of a run is the median of its per-step samples/s after
`SKIP` warm-up steps, each step timed end to end including the wait for data (our Trainer's `samples_per_s`;
open_clip's logged `<n>/s`, with --log-every-n-steps 1, whose batch time also includes the data wait). The
figure is the median over pairs of (ours / theirs).

What differs between the two (by design, not by setting):
- our text tower runs only up to the batch's longest caption (exact under CLIP's causal mask; ~20 of 77
  positions on COCO captions); open_clip encodes all 77 positions;
- open_clip's train transform is RandomResizedCrop (+ its webdataset decode), ours the squash resize;
- open_clip reads every record (the DOCCI records' `txt` too), we read only those the method wants; per step
  both process the same batch size.
- the in-process breakdown (`compute_only`) times one optimiser step on a fixed batch: ours (`Trainer.train_step`)
  vs an open_clip-style step on the same tensors (model(images, texts) at 77 tokens, open_clip `ClipLoss`,
  grad clip, AdamW), and ours with text trimming off, to separate the trimming from the rest.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

from .common import SHARDS, WORK, Row, median, python, run, shell

SKIP = 5                     # warm-up steps dropped per run (shuffle-buffer fill, allocator warm-up)
OC_STEP = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+ .*?Batch \(t\): [\d.]+, ([\d.eE+]+)/s, ")


def train_shards(shards=SHARDS) -> list[str]:
    return sorted(str(p) for p in Path(shards).glob("train-*.tar"))


def shard_brace(shards=SHARDS) -> str:
    from clipfinetune.data.prepare.shards import open_clip_pattern

    return open_clip_pattern(train_shards(shards))


# ------------------------------------------------------------------------------------------ ours (child process)
def child(model_dir: str, batch_size: int, workers: int, shards=SHARDS, max_steps: int = 0, device: str = "cpu",
          precision: str = "fp32") -> None:
    """Our stage's training path (ShardLoader + Trainer, plain CLIP), one epoch (or its first `max_steps` steps);
    prints per-step samples/s. `device`/`precision`: benchmarks/gpu.py's cuda, bf16."""
    import torch

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import DistInfo, TrainConfig, Trainer
    from clipfinetune.train.checkpoint import seed_everything

    steps = []

    class Recorder:                                 # the monitor fit() logs to: each step's samples/s
        def log(self, step, scalars):
            steps.append(scalars["samples_per_s"])

    # log_every=1: each step's own samples/s, read every step as open_clip_train's --log-every-n-steps 1 does
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=2e-4, warmup=20, wd=0.1, beta1=0.9, beta2=0.98, eps=1e-6,
                      grad_clip=1.0, workers=workers, seed=0, precision=precision, log_every=1)
    seed_everything(0)
    model = load_model("local-dir:" + model_dir, device=device)
    method = build_method("clip")
    ctx = ExampleContext.of_model(model)
    loader = ShardLoader(Path(shards), "train", method, ctx, batch_size=batch_size, seed=0, num_workers=workers,
                         pin_memory=torch.device(device).type == "cuda")          # as stage train@ on a GPU
    trainer = Trainer(method, model, loader, cfg, dist=DistInfo(device=torch.device(device)))
    if max_steps:                                   # the loop runs epoch_steps[0] steps of its one epoch
        trainer.total_steps = min(trainer.total_steps, max_steps)
        trainer.epoch_steps = [trainer.total_steps]
    t0 = time.perf_counter()
    trainer.fit(Recorder())
    print(json.dumps({"samples_per_s": steps, "wall_s": time.perf_counter() - t0, "steps": len(steps)}))


def ours_cmd(model_dir, batch_size, workers, shards=SHARDS, max_steps=0, device="cpu", precision="fp32") -> list[str]:
    return [python(), "-m", "benchmarks.fig1_openclip", "--child", "--model", str(model_dir),
            "--batch-size", str(batch_size), "--workers", str(workers), "--shards", str(shards),
            "--max-steps", str(max_steps), "--device", device, "--precision", precision]


OC_PRECISION = {"fp32": "fp32", "bf16": "amp_bf16", "fp16": "amp"}     # ours -> open_clip_train's --precision


def openclip_cmd(model_dir, batch_size, workers, n_samples, name, shards=SHARDS, device="cpu",
                 precision="fp32") -> list[str]:
    return [python(), "-m", "clipfinetune.data.open_clip_compat", "--dataset-type", "webdataset",
            "--train-data", shard_brace(shards), "--train-num-samples", str(n_samples),
            "--model", f"local-dir:{model_dir}", "--precision", OC_PRECISION[precision], "--device", device,
            "--batch-size", str(batch_size), "--workers", str(workers), "--epochs", "1",
            "--lr", "2e-4", "--wd", "0.1", "--warmup", "20", "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6",
            "--grad-clip-norm", "1.0", "--seed", "0", "--log-every-n-steps", "1",
            "--save-frequency", "0", "--zeroshot-frequency", "0", "--val-frequency", "0", "--report-to", "",
            "--logs", str(WORK / "oc_logs"), "--name", name]


def run_ours(model_dir, batch_size, workers, shards=SHARDS, max_steps=0, skip=SKIP, device="cpu",
             precision="fp32") -> dict:
    cmd = ours_cmd(model_dir, batch_size, workers, shards, max_steps, device, precision)
    rc, out, wall = run(cmd, timeout=3600)
    if rc != 0:
        raise RuntimeError(f"our trainer run failed ({rc}):\n{out[-3000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    sps = res["samples_per_s"][skip:]
    return {"median_sps": median(sps), "steps": res["steps"], "timed_steps": len(sps), "process_wall_s": wall}


def run_openclip(model_dir, batch_size, workers, n_samples, i, shards=SHARDS, skip=SKIP, device="cpu",
                 precision="fp32") -> dict:
    name = f"bench-{int(time.time())}-{i}"
    cmd = openclip_cmd(model_dir, batch_size, workers, n_samples, name, shards, device, precision)
    rc, out, wall = run(cmd, timeout=3600)
    shutil.rmtree(WORK / "oc_logs" / name, ignore_errors=True)
    if rc != 0:
        raise RuntimeError(f"open_clip_train run failed ({rc}):\n{out[-3000:]}")
    per_step = {}
    for m in OC_STEP.finditer(out):
        per_step[int(m.group(1))] = float(m.group(2))       # keyed by samples done: the last line may repeat
    sps = [v for _, v in sorted(per_step.items())]
    if not sps:
        raise RuntimeError(f"no step lines in open_clip_train's log:\n{out[-3000:]}")
    return {"median_sps": median(sps[skip:]), "steps": len(sps), "timed_steps": len(sps[skip:]),
            "process_wall_s": wall}


# ------------------------------------------------------------------------------------------ compute-only breakdown
def compute_only(model_dir, batch_size: int, reps: int = 3, steps: int = 6, samples=None) -> dict:
    """samples/s of one optimiser step on a fixed real batch: ours, ours untrimmed, open_clip-style.
    `samples`: (key, jpg bytes, record) to draw the batch from (default: the train shards)."""

    import torch
    from open_clip.loss import ClipLoss as OcClipLoss

    from clipfinetune.data.loader import ExampleContext
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import TrainConfig, Trainer

    from .fig2_methods import FixedSource, make_batch, shard_samples

    samples = samples if samples is not None else shard_samples()
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=2e-4, warmup=0, wd=0.1, grad_clip=1.0)

    def ours(trim: bool):
        model = load_model("local-dir:" + str(model_dir))
        method = build_method("clip")
        ctx = ExampleContext.of_model(model)
        batch = make_batch(method, ctx, samples, batch_size)
        if not trim:
            model._can_trim = lambda: False
        tr = Trainer(method, model, FixedSource(batch), cfg)
        tr.module.train()
        return lambda: tr.train_step([batch]), batch

    def theirs(batch):
        ours_model = load_model("local-dir:" + str(model_dir))
        # open_clip_train's loader hands its step normalised float images: our uint8 batch, normalised once here
        batch = {**batch, "image": ours_model.image_input(batch["image"])}
        model = ours_model.clip
        model.output_dict = True                                 # as open_clip_train creates it
        model.train()
        loss = OcClipLoss()
        opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1)

        def step():
            opt.zero_grad()
            out = model(batch["image"], batch["text"])
            total = loss(out["image_features"], out["text_features"], out["logit_scale"])
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                model.logit_scale.clamp_(0, 4.6052)
        return step

    ours_step, batch = ours(True)
    untrimmed_step, _ = ours(False)
    oc_step = theirs(batch)
    fns = {"ours": ours_step, "ours_untrimmed": untrimmed_step, "open_clip_style": oc_step}
    times = {k: [] for k in fns}
    for fn in fns.values():
        fn(); fn()                                               # warm-up
    for _ in range(reps):                                        # interleaved rounds
        for k, fn in fns.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    text_len = int(batch["text"].argmax(dim=1).max()) + 1
    return {k: batch_size / median(v) for k, v in times.items()} | {"text_positions_ours": text_len,
                                                                     "text_positions_open_clip": batch["text"].shape[1]}


# ------------------------------------------------------------------------------------------ the figure
def figure(model_dir, *, batch_size: int = 64, workers: int = 2, pairs: int = 3, log=print) -> list[Row]:
    from clipfinetune.data.loader import epoch_coverage
    from clipfinetune.methods import build_method

    ours = epoch_coverage(SHARDS, "train", build_method("clip"), global_batch=batch_size, world_size=1,
                          num_workers=workers)
    n_samples = ours["steps_per_epoch"] * batch_size   # open_clip: the same number of steps as our epoch
    ours_runs, oc_runs = [], []
    for i in range(pairs):
        a = run_ours(model_dir, batch_size, workers)
        log(f"  fig1 pair {i}: ours {a['median_sps']:.1f} samples/s ({a['timed_steps']} timed steps)")
        b = run_openclip(model_dir, batch_size, workers, n_samples, i)
        log(f"  fig1 pair {i}: open_clip_train {b['median_sps']:.1f} samples/s ({b['timed_steps']} timed steps)")
        ours_runs.append(a)
        oc_runs.append(b)
    ratios = [a["median_sps"] / b["median_sps"] for a, b in zip(ours_runs, oc_runs)]
    ratio = median(ratios)
    log("  fig1 compute-only breakdown (in process, fixed batch)...")
    breakdown = compute_only(model_dir, batch_size)
    commands = [shell(ours_cmd(model_dir, batch_size, workers)),
                shell(openclip_cmd(model_dir, batch_size, workers, n_samples, "bench-<ts>-<i>")),
                f"in process: benchmarks.fig1_openclip.compute_only(model, batch_size={batch_size})"]
    row = Row("1 Trainer vs open_clip_train (samples/s)", median([a["median_sps"] for a in ours_runs]),
              median([b["median_sps"] for b in oc_runs]), ratio, ">= 1.0x", ratio >= 1.0, "samples/s",
              {"batch_size": batch_size, "workers": workers, "pairs": pairs, "warmup_steps_dropped": SKIP,
               "ratio_per_pair": ratios, "ours_runs": ours_runs, "open_clip_runs": oc_runs,
               "compute_only_samples_per_s": breakdown}, commands)
    return [row]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shards", default=str(SHARDS))
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32")
    a = ap.parse_args()
    if not a.child:
        sys.exit("use `python -m benchmarks --only 1`")
    child(a.model, a.batch_size, a.workers, a.shards, a.max_steps, a.device, a.precision)
