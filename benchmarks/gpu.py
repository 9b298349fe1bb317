"""`python -m benchmarks --gpu`: every method's training step on one CUDA GPU (issue 32's baseline table).

ViT-B-16 (random init, full depth) at 224 px, bf16 autocast, batch 128; each method's own batch built by its
`make_example` from the sample world's shards (data/shards: run `dvc repro shards` first), moved to the GPU once;
`Trainer.train_step` (forward, loss, backward, clip, fused AdamW, clamp, after_step) timed with CUDA events after
warm-up steps, median of `STEPS`. FLOPs: `FlopCounterMode` around one `compute_gradients` (fig2's `count_flops`).
The card's rate: a bf16 8192^3 GEMM timed on the same card; a method's share = achieved TFLOP/s / the GEMM's.
Without CUDA it says so and exits 0 (the CPU figures are `python -m benchmarks`).
"""
from __future__ import annotations

import statistics

BATCH, WARMUP, STEPS, GEMM_N = 128, 3, 10, 8192


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


def method_step(name: str, model_dir, params: dict, log) -> dict:
    import torch

    from clipfinetune.data.loader import ExampleContext
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import DistInfo, TrainConfig, Trainer

    from .fig2_methods import FixedSource, count_flops, make_batch, method_config, shard_samples

    device = torch.device("cuda:0")
    model = load_model("local-dir:" + str(model_dir), device=device)
    method = build_method(name, **method_config(name, params))
    ctx = ExampleContext(model.transform, model.tokenize, model.image_size, token_span=model.token_span,
                         tokenize_long=lambda texts: model.tokenize(texts, context_length=248))
    cfg = TrainConfig(epochs=1, batch_size=BATCH, lr=1e-5, wd=0.1, grad_clip=1.0, precision="bf16")
    trainer = Trainer(method, model, FixedSource(None), cfg, dist=DistInfo(device=device), desc=f"gpu-{name}")
    batch = trainer._to_device(make_batch(method, ctx, shard_samples(), BATCH))
    trainer.module.train()
    flops = count_flops(trainer, batch)
    torch.cuda.reset_peak_memory_stats()
    cuda_ms(lambda: trainer.train_step([batch]), WARMUP)
    ms = statistics.median(cuda_ms(lambda: trainer.train_step([batch]), STEPS))
    row = {"method": name, "ms_per_step": ms, "samples_per_s": BATCH / ms * 1e3,
           "tflops": flops / (ms / 1e3) / 1e12, "peak_gb": torch.cuda.max_memory_allocated() / 1e9}
    log(f"  gpu {name}: {ms:.1f} ms/step, {row['tflops']:.0f} TFLOP/s")
    return row                                  # the trainer is freed on return; main() empties the cache


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
    return 0
