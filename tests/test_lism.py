"""LISM (GOAL §3.1): segments -> boxes, sentence-region matching, the global-wins rule, measurement."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from clipfinetune.data.prepare.lism import (
    SentenceMatch,
    box_iou,
    choose_test_pair,
    choose_training_pair,
    match_sentences,
    measure_against_ground_truth,
)
from clipfinetune.data.prepare.segments import (
    felzenszwalb_masks,
    filter_segments,
    mask_to_box,
    segment_image,
)
from clipfinetune.parts import units_of_rank, work_units


def _scene(h=64, w=80):
    """Grey background with a red 20x16 rectangle and a blue 10x10 square."""
    img = np.full((h, w, 3), 90, np.uint8)
    img[5:21, 10:30] = (220, 30, 30)      # rows 5..20, cols 10..29
    img[40:50, 50:60] = (30, 30, 220)
    return img


def test_mask_to_box_is_tight_in_pixel_edges():
    mask = np.zeros((10, 12), bool)
    mask[2:5, 3:9] = True
    assert mask_to_box(mask) == (3.0, 2.0, 9.0, 5.0)
    assert mask_to_box(np.zeros((4, 4), bool)) is None


def test_area_filter_keeps_one_to_eighty_percent_inclusive():
    area = 100
    def m(n):
        x = np.zeros((10, 10), bool)
        x.flat[:n] = True
        return x
    kept = filter_segments([m(0), m(1), m(50), m(80), m(81), m(100)], area, 0.01, 0.8)
    assert sorted(round(s.area_frac, 2) for s in kept) == [0.01, 0.5, 0.8]


def test_cpu_segmenter_finds_the_drawn_objects():
    img = _scene()
    boxes = [s.box for s in segment_image(img, felzenszwalb_masks, 0.01, 0.8)]
    for truth in [(10, 5, 30, 21), (50, 40, 60, 50)]:
        assert max(box_iou(b, truth) for b in boxes) > 0.9


def test_cpu_segmenter_drops_the_background_even_when_objects_split_it():
    """A bar from top to bottom splits the grey background into two parts (each within the 1-80% area window);
    regions touching the border are background: only the two squares inside remain."""
    img = np.full((64, 80, 3), 90, np.uint8)
    img[:, 36:44] = (30, 200, 30)                       # touches the top and bottom border: dropped too
    img[10:20, 10:20] = (220, 30, 30)
    img[40:50, 55:65] = (30, 30, 220)
    boxes = sorted(s.box for s in segment_image(img, felzenszwalb_masks, 0.01, 0.8))
    assert len(boxes) == 2
    assert max(box_iou(boxes[0], (10, 10, 20, 20)), box_iou(boxes[1], (10, 10, 20, 20))) > 0.9
    assert max(box_iou(boxes[0], (55, 40, 65, 50)), box_iou(boxes[1], (55, 40, 65, 50))) > 0.9


@pytest.mark.timeout(120)
def test_sam_path_with_real_sam_without_checkpoint(monkeypatch):
    """A real Sam from sam_model_registry (random weights): thresholds at 0 so that masks do appear.

    The registry's vit_b is built for real but on the meta device (layout only: a CPU forward of its 1024-px
    encoder took ~60 s of the unit suite); the masks come from segment-anything's own `_build_sam` with vit_b's
    layout shrunk (2 blocks, one windowed and one global, width 64), same prompt encoder, mask decoder, 1024-px
    input and mask generator. Four points in two batches."""
    from functools import partial

    from segment_anything import sam_model_registry
    from segment_anything.build_sam import _build_sam
    from segment_anything.modeling import Sam

    from clipfinetune.data.prepare.segments import build_sam, sam_masks_fn

    with torch.device("meta"):
        vit_b = build_sam("vit_b", checkpoint=None, device="meta")
    assert isinstance(vit_b, Sam) and not vit_b.training
    assert len(vit_b.image_encoder.blocks) == 12 and vit_b.image_encoder.patch_embed.proj.out_channels == 768

    monkeypatch.setitem(sam_model_registry, "test_small", partial(
        _build_sam, encoder_embed_dim=64, encoder_depth=2, encoder_num_heads=2, encoder_global_attn_indexes=[1]))
    torch.manual_seed(0)
    sam = build_sam("test_small", checkpoint=None)
    assert isinstance(sam, Sam) and not sam.training
    masks_fn = sam_masks_fn(sam, points_per_side=2, pred_iou_thresh=0.0, stability_score_thresh=0.0,
                            points_per_batch=2)
    img = _scene(32, 32)
    masks = masks_fn(img)
    assert len(masks) > 0 and masks[0].shape == (32, 32) and masks[0].dtype == bool
    segments = filter_segments(masks, 32 * 32, 0.01, 0.8)
    for s in segments:
        assert 0.01 <= s.area_frac <= 0.8
        x0, y0, x1, y1 = s.box
        assert 0 <= x0 < x1 <= 32 and 0 <= y0 < y1 <= 32


def test_sharded_segmentation_merges_to_the_single_run():
    rng = np.random.default_rng(0)
    images = {f"img{i}": np.clip(_scene() + rng.integers(0, 20, (64, 80, 3)), 0, 255).astype(np.uint8)
              for i in range(5)}
    ids = sorted(images)

    def run(id_list):
        return [(i, k, s.box) for i in id_list
                for k, s in enumerate(segment_image(images[i], felzenszwalb_masks))]
    single = run(ids)
    units = work_units(ids, 2)
    by_rank = [[i for k in units_of_rank(len(units), rank, 2) for i in units[k]] for rank in range(2)]
    merged = sorted(run(by_rank[0]) + run(by_rank[1]))
    assert merged == sorted(single)
    assert sorted(by_rank[0] + by_rank[1]) == ids


def test_each_sentence_goes_to_its_most_similar_candidate():
    cand = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    sent = torch.nn.functional.normalize(cand[[2, 0, 3]] + 0.01 * torch.randn(3, 8), dim=-1)
    matches = match_sentences(sent, cand)
    assert [m.candidate for m in matches] == [2, 0, 3]
    for m in matches:
        assert m.score == pytest.approx(100 * float(sent[m.sentence_index] @ cand[m.candidate]), rel=1e-5)


def test_global_wins_rule():
    all_global = [SentenceMatch(0, 0, 30.0), SentenceMatch(1, 0, 25.0)]
    assert choose_training_pair(all_global) is None
    assert choose_test_pair(all_global).candidate == 0
    mixed = [SentenceMatch(0, 0, 40.0), SentenceMatch(1, 2, 25.0), SentenceMatch(2, 1, 28.0)]
    best = choose_training_pair(mixed)
    assert (best.sentence_index, best.candidate) == (2, 1)   # the global-won sentence is removed first
    assert choose_test_pair(mixed).candidate == 0             # the test list keeps the global winner


def test_measurement_counts_iou_and_non_object_sentences():
    truth = {("a", "red circle"): (0, 0, 10, 10), ("b", "blue square"): (20, 20, 30, 30)}
    rows = [
        {"image_id": "a", "sentence": "red circle", "kind": "region", "box": (1, 1, 10, 10), "chosen": True},
        {"image_id": "b", "sentence": "summary", "kind": "region", "box": (20, 20, 30, 30), "chosen": True},
        {"image_id": "b", "sentence": "blue square", "kind": "global", "box": (0, 0, 64, 64), "chosen": False},
    ]
    m = measure_against_ground_truth(rows, truth, n_images=4)
    assert m["accuracy"] == 50.0          # a: IoU 0.81 correct; b chose a non-object sentence
    assert m["coverage"] == 50.0          # 2 of 4 images got a pair
    assert m["sentence_accuracy"] == 50.0  # red circle right, blue square went to the global image


def test_lism_stages_never_read_instances_or_ground_truth_as_deps():
    with open("dvc.yaml") as f:
        stages = yaml.safe_load(f)["stages"]
    for name in ("segments", "lism"):
        deps = " ".join(stages[name]["do"]["deps"])      # a foreach over <stage>.sources
        assert "instances" not in deps and "ground_truth" not in deps


def test_lism_stage_on_real_data_without_ground_truth_writes_its_metrics_file(tmp_path, monkeypatch):
    """metrics/lism.json is a DVC output of the stage: with `lism.ground_truth: ""` (real data) it holds the
    pair counts instead of an accuracy, so `dvc repro` finds every output. DOCCI's qual_dev / qual_test records
    are neither training images nor in the test list (counted)."""
    import json
    import sys

    from stages import _common
    from stages import lism as stage

    import pandas as pd
    from PIL import Image

    from clipfinetune.models import export_model, load_model

    monkeypatch.chdir(tmp_path)
    StageParams = _common.StageParams

    export_model(load_model("cft-tiny-vit"), tmp_path / "matcher")
    lines = []
    ids = ("train_00000", "test_00000", "qual_dev_00000", "qual_test_00000")
    for ex, split in zip(ids, ("train", "test", "qual_dev", "qual_test")):
        Image.fromarray(_scene()).save(tmp_path / f"{ex}.jpg")
        lines.append(json.dumps({"example_id": ex, "split": split, "image_file": f"{ex}.jpg",
                                 "description": "A red box. A blue square."}))
    (tmp_path / "docci.jsonlines").write_text("\n".join(lines) + "\n")
    pd.DataFrame([{"image_id": ex, "sentence_index": k, "text": t} for ex in ids
                  for k, t in enumerate(("A red box.", "A blue square."))]).to_parquet(tmp_path / "sentences.parquet")
    pd.DataFrame([{"image_id": ex, "segment_id": 0, "x0": 10.0, "y0": 5.0, "x1": 30.0, "y1": 21.0, "area_frac": 0.06}
                  for ex in ids]).to_parquet(tmp_path / "segments.parquet")
    params = StageParams("lism@docci", {
        "sources": {"docci": {"reader": "docci", "descriptions": "docci.jsonlines", "images": "."}},
        "lism": {"model": "matcher", "pretrained": "", "sources": ["docci"], "sentences": "sentences.parquet",
                 "segments": "segments.parquet", "ground_truth": "", "batch_size": 8}})
    monkeypatch.setenv("CLIPFINETUNE_LISM_WORKERS", "1")          # the host's count: one DataLoader worker
    monkeypatch.setattr(_common, "stage_params", lambda name=None: params)
    monkeypatch.setattr(sys, "argv", ["stages/lism.py", "--stage", "lism@docci"])
    stage.main()
    metrics = json.loads((tmp_path / "metrics" / "lism.json").read_text())["lism"]
    assert metrics == {"n_images": 1, "n_pairs": metrics["n_pairs"], "global_wins": 1 - metrics["n_pairs"]}
    test_dir = tmp_path / "data/evalsets/global_local"
    listed = json.loads((test_dir / "test.json").read_text())
    assert [item["image_id"] for item in listed] == ["test_00000"] * 2
    assert (test_dir / listed[0]["filename"]).read_bytes() == (tmp_path / "test_00000.jpg").read_bytes()
    assert all((test_dir / item["filename"]).is_file() for item in listed)
    assert not [p for p in (tmp_path / "data" / "cache").rglob("*") if p.is_file()]     # the parts' files went too
    meta = json.loads((tmp_path / "data/prepared/local_pairs.meta.json").read_text())
    assert (meta["n_train_images"], meta["n_test_images"]) == (1, 1)
    assert meta["other_splits"] == {"qual_dev": 1, "qual_test": 1} and not meta["skipped"]
    assert set(pd.read_parquet(tmp_path / "data/prepared/local_pairs.parquet")["image_id"]) == {"train_00000"}


def test_match_image_forwards_at_one_thread_whatever_the_callers_count(monkeypatch):
    """The scores are written to disk: their bits must not follow the caller's torch thread count (issue 26)."""
    from clipfinetune.data.prepare.lism import match_image
    from clipfinetune.models import load_model

    torch.manual_seed(0)
    model = load_model("cft-tiny-vit").eval()
    seen = []
    encode_image = model.encode_image
    monkeypatch.setattr(model, "encode_image", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                                encode_image(*a, **k))[1])
    from PIL import Image

    image = Image.fromarray(_scene())
    boxes = [(10.0, 5.0, 30.0, 21.0), (50.0, 40.0, 60.0, 50.0), (0.0, 0.0, 40.0, 64.0)]
    sentences = ["A red box.", "A blue square beside it.", "A grey wall."]
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            results[threads] = [(m.sentence_index, m.candidate, m.score)
                                for m in match_image(model, image, sentences, boxes, batch_size=2)]
            assert torch.get_num_threads() == threads          # the caller's count is given back
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert results[1] == results[2]


def _world(tmp_path, n: int = 5, test_every: int = 2):
    """`n` DOCCI-like records on disk (every `test_every`-th a test image, one of another split), their sentences and
    segment boxes (`lism_inputs`' shapes), and a tiny random matcher model."""
    from PIL import Image

    from clipfinetune.data.readers import Record
    from clipfinetune.models import load_model

    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    records, texts, boxes = [], {}, {}
    for k in range(n):
        image_id = f"img_{k:02d}"
        path = tmp_path / "images" / f"{image_id}.jpg"
        path.parent.mkdir(exist_ok=True)
        Image.fromarray(np.clip(_scene() + rng.integers(0, 40, (64, 80, 3)), 0, 255).astype(np.uint8)).save(path)
        split = "qual_test" if k == n - 1 else "test" if k % test_every == 0 else "train"
        texts[image_id] = [f"A red box {k}.", "A blue square.", "A grey wall."][: 1 + k % 3]
        boxes[image_id] = [(10.0, 5.0, 30.0, 21.0), (50.0, 40.0, 60.0, 50.0), (0.0, 0.0, 40.0 + k, 64.0)][: 1 + k % 3]
        records.append(Record("docci", image_id, path.name, tmp_path / "images", split=split,
                              long_caption=" ".join(texts[image_id])))
    return records, texts, boxes, load_model("cft-tiny-vit").eval()


def _files(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_shared_gpu_style_batches_match_the_per_image_path(tmp_path):
    """The GPU path (crops and sentences of a unit's images in shared batches) keeps every image's decisions; its
    scores differ from the per-image path only in float rounding (here both run on the CPU)."""
    from clipfinetune.data.prepare.lism import Matcher

    records, texts, boxes, model = _world(tmp_path)
    (one_by_one,), (shared,) = (Matcher(model, texts, boxes, 2, tmp_path / f"files-{s}", shared_batches=s)([records])
                                for s in (False, True))
    assert [len(r.get("matches", [])) for r in shared] == [len(texts[r.image_id]) if r.split != "qual_test" else 0
                                                            for r in records]
    for a, b in zip(one_by_one, shared):
        assert [m[:2] for m in a.get("matches", [])] == [m[:2] for m in b.get("matches", [])]
        assert [m[2] for m in a.get("matches", [])] == pytest.approx([m[2] for m in b.get("matches", [])], abs=1e-3)


def test_units_give_the_same_results_and_test_files_at_any_rank_count_and_worker_count(tmp_path):
    """LISM's units, test list included, do not depend on how they are dealt: one process matching every unit
    (images decoded in this thread) and two ranks each matching its round-robin share (2 DataLoader workers, one
    shared folder for the files, as the part store has) give the same per-image results and the same file bytes."""
    from clipfinetune.data.prepare.lism import Matcher
    from clipfinetune.parts import units_of_rank, work_units

    records, texts, boxes, model = _world(tmp_path, n=7)
    units = work_units(records, 2)
    single = list(Matcher(model, texts, boxes, 2, tmp_path / "one", workers=0)(units))
    by_rank = {}
    for rank in range(2):
        mine = units_of_rank(len(units), rank, 2)
        by_rank.update(zip(mine, Matcher(model, texts, boxes, 2, tmp_path / "two",
                                         workers=2)([units[k] for k in mine])))
    assert [by_rank[k] for k in range(len(units))] == single
    tests_of_rank = [sum("test" in r for k in units_of_rank(len(units), rank, 2) for r in by_rank[k])
                     for rank in (0, 1)]
    assert min(tests_of_rank) > 0                        # both ranks wrote test items: the tail is in the units
    assert _files(tmp_path / "one") == _files(tmp_path / "two") and _files(tmp_path / "one")


def test_a_test_image_is_its_original_file_linked_and_its_crop_a_png_of_the_chosen_box(tmp_path):
    from PIL import Image

    from clipfinetune.data.evalsets.global_local import read_joint_list, write_test_list
    from clipfinetune.data.prepare.lism import Matcher, choose_test_pair

    records, texts, boxes, model = _world(tmp_path)
    out = tmp_path / "files"
    (results,) = Matcher(model, texts, boxes, 4, out)([records])
    tests = [(rec, res) for rec, res in zip(records, results) if rec.split == "test"]
    assert tests and all("test" in res for _, res in tests)
    assert all("test" not in res for rec, res in zip(records, results) if rec.split != "test")
    for rec, res in tests:
        global_item, local_item = res["test"]
        original = out / global_item["filename"]
        assert original.read_bytes() == rec.path.read_bytes()               # never re-encoded
        assert original.stat().st_ino == rec.path.stat().st_ino             # a hard link on one file system
        assert global_item["caption"] == rec.long_caption
        best = choose_test_pair([SentenceMatch(*m) for m in res["matches"]])
        assert local_item["caption"] == texts[rec.image_id][best.sentence_index]
        assert local_item["similarity_score"] == round(best.score, 4)
        local = out / local_item["filename"]
        if best.candidate:
            box = tuple(round(v) for v in boxes[rec.image_id][best.candidate - 1])
            expected = np.asarray(Image.open(rec.path).convert("RGB").crop(box))
            assert local.suffix == ".png" and np.array_equal(np.asarray(Image.open(local)), expected)
        else:
            assert local.name == "original_image.jpg" and local.read_bytes() == rec.path.read_bytes()
    write_test_list(out, [res["test"] for _, res in tests])
    joint = read_joint_list(out / "test.json", None)
    assert [(r.group, r.is_local) for r in joint] == [(rec.image_id, False) for rec, _ in tests] + \
        [(rec.image_id, True) for rec, _ in tests]


def test_the_global_image_winning_links_the_original_as_the_local_item(tmp_path):
    from clipfinetune.data.evalsets.global_local import item_names, write_items

    records, *_ = _world(tmp_path, n=2)
    rec = records[0]
    g, local = write_items(rec, "A red box 0.", 0, None, 31.23456, tmp_path / "out")
    assert (g["filename"], local["filename"]) == item_names(rec.image_id, rec.image, 0) == \
        ("photos/img_00.jpg", "segments/img_00.jpg_results/original_image.jpg")
    for item in (g, local):
        assert (tmp_path / "out" / item["filename"]).read_bytes() == rec.path.read_bytes()
    assert local["similarity_score"] == 31.2346


def test_a_killed_rank_leaves_no_worker_or_writer_process_behind(tmp_path):
    """SIGKILL of a rank mid-run (a machine taken back, the OOM killer): its DataLoader workers and test-list writer
    processes end by themselves instead of waiting for work forever."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "rank.py"
    script.write_text(f"""
import multiprocessing, sys, time
from pathlib import Path
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
from test_lism import _world
from clipfinetune.data.prepare.lism import Matcher
records, texts, boxes, model = _world(Path({str(tmp_path)!r}), n=7)
units = Matcher(model, texts, boxes, 2, Path({str(tmp_path / "files")!r}), workers=2)(\
[records[i:i + 2] for i in range(0, 7, 2)])
next(units)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
time.sleep(300)
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    children = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(children) >= 3                       # 2 DataLoader workers and at least one writer
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def alive(pid: int) -> bool:
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()     # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid in children if alive(pid)]
    for pid in left:                                # never leave them running, whatever the outcome
        os.kill(pid, signal.SIGKILL)
    assert not left
