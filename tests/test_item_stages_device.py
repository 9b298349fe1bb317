"""The item stages (segments, lism, eval) put their model on cuda:LOCAL_RANK when CUDA is reported present and
`compute.device` is auto, and record that device in their outputs' metadata (issue 32). CUDA is mocked: the model
loaders are replaced by recorders that return a CPU model, so the stages run through on a CPU-only host."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from stages import _common

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cuda_rank_1(monkeypatch, tmp_path):
    """CUDA reported present, this process local rank 1 of a 1-process world; cwd a tiny DOCCI-style source."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    lines = []
    for ex, split in (("train_00000", "train"), ("test_00000", "test")):
        img = np.full((48, 64, 3), 90, np.uint8)
        img[8:24, 10:30] = (220, 30, 30)
        Image.fromarray(np.clip(img + rng.integers(0, 20, img.shape), 0, 255).astype(np.uint8)).save(f"{ex}.jpg")
        lines.append(json.dumps({"example_id": ex, "split": split, "image_file": f"{ex}.jpg",
                                 "description": "A red box. A grey wall."}))
    Path("docci.jsonlines").write_text("\n".join(lines) + "\n")
    return {"docci": {"reader": "docci", "descriptions": "docci.jsonlines", "images": "."}}


def _run(monkeypatch, stage_module: str, stage: str, values: dict, argv=()):
    module = importlib.import_module(f"stages.{stage_module}")
    params = _common.StageParams(stage, values)
    monkeypatch.setattr(_common, "stage_params", lambda name=None: params)
    monkeypatch.setattr(_common, "stage_inputs", lambda name: {})    # the test's inputs are not dvc.yaml's
    monkeypatch.setattr(sys, "argv", [f"stages/{stage_module}.py", *argv, "--stage", stage])
    module.main()
    return module


def _tiny_model():
    from clipfinetune.models import load_model

    torch.manual_seed(0)
    return load_model("cft-tiny-vit").eval()


def test_segments_puts_sam_on_cuda_local_rank_and_records_it(monkeypatch, cuda_rank_1):
    from stages import segments as stage

    from clipfinetune.data.prepare.segments import felzenszwalb_masks

    asked = []
    monkeypatch.setattr(stage, "build_sam", lambda sam_type, checkpoint, device: asked.append(device))
    monkeypatch.setattr(stage, "sam_masks_fn", lambda sam, **kw: felzenszwalb_masks)
    _run(monkeypatch, "segments", "segments", {
        "sources": cuda_rank_1, "segments": {
            "sources": ["docci"], "sam_checkpoint": "sam.pth", "sam_type": "vit_b", "points_per_side": 8,
            "pred_iou_thresh": 0.5, "stability_score_thresh": 0.5, "min_area": 0.01, "max_area": 0.8}})
    assert asked == ["cuda:1"]
    assert json.loads(Path("data/prepared/segments.meta.json").read_text())["device"] == "cuda:1"


def test_lism_puts_its_model_on_cuda_local_rank_and_records_it(monkeypatch, cuda_rank_1):
    from stages import lism as stage

    asked, model = [], _tiny_model()
    monkeypatch.setattr(stage, "load_model_for_lism", lambda name, pretrained, device: (asked.append(device), model)[1])
    ids = ("train_00000", "test_00000")
    pd.DataFrame([{"image_id": ex, "sentence_index": k, "text": t} for ex in ids
                  for k, t in enumerate(("A red box.", "A grey wall."))]).to_parquet("sentences.parquet")
    pd.DataFrame([{"image_id": ex, "segment_id": 0, "x0": 10.0, "y0": 8.0, "x1": 30.0, "y1": 24.0, "area_frac": 0.1}
                  for ex in ids]).to_parquet("segments.parquet")
    monkeypatch.setenv("CLIPFINETUNE_LISM_WORKERS", "0")
    _run(monkeypatch, "lism", "lism", {
        "sources": cuda_rank_1, "lism": {"model": "matcher", "pretrained": "", "sources": ["docci"],
                                         "sentences": "sentences.parquet", "segments": "segments.parquet",
                                         "ground_truth": "", "batch_size": 8}})
    assert [str(d) for d in asked] == ["cuda:1"]
    assert json.loads(Path("data/prepared/local_pairs.meta.json").read_text())["device"] == "cuda:1"


def test_eval_puts_its_model_on_cuda_local_rank_and_records_it(monkeypatch, cuda_rank_1):
    from stages import eval as stage

    asked, model = [], _tiny_model()
    monkeypatch.setattr(stage, "load_exported", lambda name, device: (asked.append((name, device)), model)[1])
    Path("shapes/test/square").mkdir(parents=True)
    Image.open("train_00000.jpg").save("shapes/test/square/0.jpg")
    Path("shapes/classnames.txt").write_text("square\n")
    _run(monkeypatch, "eval", "eval@base", {"eval": {
        "batch_size": 4, "aro_seed": 1, "cache_dir": "", "box_cls": {"text_encoder": "own"},
        "evalsets": {"zeroshot": {"shapes": {"dir": "shapes", "split": "test"}}}}}, ["--model", "tiny"])
    assert [(n, str(d)) for n, d in asked] == [("tiny", "cuda:1")]
    metrics = json.loads(Path("metrics/tiny.json").read_text())
    assert metrics["meta"]["device"] == "cuda:1" and "zeroshot" in metrics
