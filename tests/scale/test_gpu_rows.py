"""benchmarks/gpu.py's rows beyond the step table run on the CPU at a tiny size (not timed: only that each row's
code runs and returns its fields): `extra_rows` with the bundled tiny ViT, 640 x 480 JPEG shards, one loader
worker, three steps; our Trainer and open_clip_train as separate processes; SAM vit_b (random init) at 2 x 2
points on a 256 x 192 image. And `python -m benchmarks --gpu` without CUDA says so and exits 0. Minutes (SAM's
vit_b image encoder at 1024 px, two training processes): tests/scale/.
"""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu
from clipfinetune.models import export_model, load_model


def test_every_extra_row_runs_on_the_cpu_and_returns_its_fields(tmp_path):
    model_dir = tmp_path / "model"
    export_model(load_model("cft-tiny-vit"), model_dir)
    size = gpu.SIZES["tiny"]
    logged = []
    out = gpu.extra_rows(model_dir, tmp_path / "work", size, "cpu", "fp32", log=logged.append)
    e2e = out["end_to_end"]
    assert e2e["ours"]["steps"] == size["steps"] and e2e["open_clip_train"]["steps"] >= size["steps"]
    for key in ("ours_samples_per_s", "open_clip_train_samples_per_s", "ratio"):
        assert math.isfinite(e2e[key]) and e2e[key] > 0, key
    loader = out["loader"]
    assert loader["loader_samples"] > 0 and loader["loader_samples"] % size["batch"] == 0
    assert loader["step_samples_per_s"] > 0 and loader["ratio"] > 0
    assert out["eval"]["images"] == size["eval_images"] and out["eval"]["images_per_s"] > 0
    sam = out["sam"]
    assert len(sam["seconds_per_image"]) == size["sam_images"] and sam["image_size"] == list(size["sam_size"])
    assert sam["device"] == "cpu" and sam["points_per_side"] == size["sam_points"]
    lism = out["lism"]
    assert lism["crops"] == size["lism_images"] * (1 + size["lism_boxes"]) and lism["matched"] == size["lism_images"]
    assert len(logged) == 5
    gpu.print_extra(out)                       # the table prints from these fields


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_flag_without_cuda_says_so_and_exits_0():
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--gpu"], capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device" in proc.stdout
