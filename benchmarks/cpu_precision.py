"""bf16 autocast against fp32 on this CPU: is `model.precision: bf16` a speed-up here or an emulation?

`python -m benchmarks.cpu_precision [--batch 128] [--rounds 3] [--steps 3]`

One contrastive training step of the sample world's tiny CLIP (`cft-tiny-vit`, random weights, synthetic 64x64
images and one ~10-token caption padded to the context length, batch 128 as `pretrain`): forward under
`train.config.autocast`, the CLIP loss in fp32, backward, AdamW. 2 warm-up steps per precision, then `rounds`
interleaved rounds of `steps` steps each (the order alternates every round), median step time. Prints the CPU's bf16
capability (`train.config.cpu_has_native_bf16`: AVX512-BF16 or AMX) and the ratio bf16 / fp32 (> 1: bf16 is slower).
No data, no stage: runs from a fresh clone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from clipfinetune.losses.common import clip_contrastive_loss
from clipfinetune.models import load_model
from clipfinetune.train.config import autocast, cpu_has_native_bf16


def step_fn(model, opt, images, tokens, precision: str):
    device = images.device

    def step() -> float:
        t0 = time.perf_counter()
        with autocast(precision, device):
            x = model.encode_image(images, normalize=True)
            t = model.encode_text(tokens, normalize=True)
        loss = clip_contrastive_loss(x.float(), t.float(), model.clip.logit_scale.exp())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0
    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    model = load_model("cft-tiny-vit")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    size = model.clip.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.randn(a.batch, 3, size, size)
    words = ["a red triangle left of a blue ring."] * a.batch
    tokens = model.tokenize(words)
    steps = {p: step_fn(model, opt, images, tokens, p) for p in ("fp32", "bf16")}
    for step in steps.values():                         # warm-up: allocator, oneDNN primitive caches
        step(), step()
    times: dict[str, list[float]] = {p: [] for p in steps}
    order = list(steps)
    for r in range(a.rounds):
        for p in (order if r % 2 == 0 else order[::-1]):
            times[p] += [steps[p]() for _ in range(a.steps)]
    med = {p: statistics.median(v) for p, v in times.items()}
    out = {"cpu_has_native_bf16": cpu_has_native_bf16(), "threads": torch.get_num_threads(), "batch": a.batch,
           "fp32_s": med["fp32"], "bf16_s": med["bf16"], "bf16_over_fp32": med["bf16"] / med["fp32"]}
    print(f"native bf16 (AVX512-BF16 or AMX): {out['cpu_has_native_bf16']}, {out['threads']} threads, batch {a.batch}")
    print(f"contrastive step, median of {a.rounds * a.steps}: fp32 {med['fp32']:.3f} s, bf16 {med['bf16']:.3f} s, "
          f"bf16 / fp32 = {out['bf16_over_fp32']:.2f}")
    return out


if __name__ == "__main__":
    main()
