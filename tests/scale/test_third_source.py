"""A third training source declared only in params.yaml (issue #23): image-text pairs as a CSV table, the form of
FSC-CLIP's LAION-COCO / CC3M subsets, trained on by `clip` and `fsc_clip` with no code or dvc.yaml change.

In a throw-away copy of the project: the test writes the images and the table, adds `sources.pairs` and sets
`shards.sources: [pairs]` in params.yaml, and runs the stages `shards`, `train@clip` and `train@fsc_clip` as DVC
would (their own command lines), on a tiny exported base model.
"""
from __future__ import annotations

import csv
import json
import math
import random
import tarfile

import pytest
from fixtures.project import copy_project, write_params
from fixtures.project import run as _run

COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 180, 60), "yellow": (230, 210, 40)}
SHAPES = ("circle", "square")
N_IMAGES = 40


def _image(path, colour: str, shape: str, other: str, seed: int) -> None:
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (48, 48), (245, 245, 245))
    draw = ImageDraw.Draw(img)
    for (fill, kind), x in (((COLOURS[colour], shape), 4), ((COLOURS[other], "square"), 26)):
        y = 4 + rng.randrange(20)
        box = (x, y, x + 18, y + 18)
        (draw.ellipse if kind == "circle" else draw.rectangle)(box, fill=fill)
    img.save(path, quality=95)


def _pairs(root) -> list[tuple[str, str]]:
    (root / "pairs" / "images").mkdir(parents=True)
    rows, names = [], list(COLOURS)
    for i in range(N_IMAGES):
        colour, other, shape = names[i % 4], names[(i + 1 + i // 4) % 4], SHAPES[i % 2]
        name = f"{i:05d}.jpg"
        _image(root / "pairs" / "images" / name, colour, shape, other, i)
        rows.append((name, f"a {colour} {shape} to the left of a {other} square"))
        if i % 3 == 0:                     # some images have a second caption (grouped into one record)
            rows.append((name, f"a {other} square to the right of a {colour} {shape}"))
    with open(root / "pairs" / "pairs.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["filepath", "title"])                 # open_clip's CsvDataset column names
        writer.writerows(rows)
    return rows


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("third") / "project")
    rows = _pairs(repo)
    write_params(repo, {
        "sources": {"pairs": {"reader": "pairs", "table": "pairs/pairs.csv", "images": "pairs/images",
                              "image_column": "filepath", "caption_column": "title"}},
        "shards": {"sources": ["pairs"], "maxcount": 16},
        "train": {"epochs": 2, "batch_size": 8, "warmup": 1, "checkpoint_every": 0}})
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / "models" / "base")
    _run(repo, "git", "init", "-q")
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a third source")
    _run(repo, "python", "stages/shards.py", "--stage", "shards")
    for run in ("clip", "fsc_clip"):
        if run == "fsc_clip":                      # clip's checkpoints go after its export, fsc_clip's are kept
            write_params(repo, {"train": {"keep_checkpoint": True}})
        _run(repo, "python", "stages/run_settings.py", "--stage", "run_settings")     # data/runs/<run>.json
        _run(repo, "python", "stages/train.py", "--run", run, "--method", run, "--stage", f"train@{run}")
    return repo, rows


def test_a_runs_checkpoints_are_removed_after_its_export_unless_kept(project):
    repo, _ = project
    assert (repo / "models" / "clip").is_dir() and not (repo / "checkpoints" / "clip").exists()
    assert (repo / "models" / "fsc_clip").is_dir() and (repo / "checkpoints" / "fsc_clip" / "last.pt").is_file()


def _samples(repo) -> dict[str, dict]:
    out = {}
    for tar in sorted((repo / "data" / "shards").glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf:
                key, ext = m.name.split(".", 1)
                if ext == "json":
                    out[key] = json.loads(tf.extractfile(m).read())
    return out


def test_the_shards_hold_one_sample_per_image_of_the_table_with_its_captions(project):
    repo, rows = project
    samples = _samples(repo)
    by_image: dict[str, list[str]] = {}
    for name, caption in rows:
        by_image.setdefault(name, []).append(caption)
    assert {s["image_id"]: s["captions"] for s in samples.values()} == by_image
    assert all(key.startswith("pairs_") and s["source"] == "pairs" for key, s in samples.items())
    assert all(s["long_caption"] == "" and s["word_regions"] == [] and s["negatives"] == [] for s in samples.values())
    meta = json.loads((repo / "data" / "shards" / "meta.json").read_text())
    assert meta["records"] == N_IMAGES and meta["samples_train"] + meta["samples_val"] == N_IMAGES


@pytest.mark.parametrize("run", ["clip", "fsc_clip"])
def test_clip_and_fsc_clip_train_on_the_pairs_and_export_a_changed_model(project, run):
    from safetensors.torch import load_file

    repo, _ = project
    data = json.loads((repo / "dvclive" / "train" / run / "data.json").read_text())
    meta = json.loads((repo / "data" / "shards" / "meta.json").read_text())
    assert data["samples"] == data["wanted"] == meta["samples_train"] > 0 and not data.get("dropped_by_method")
    metrics = json.loads((repo / "dvclive" / "train" / run / "metrics.json").read_text())
    assert metrics["step"] > 0 and math.isfinite(metrics["loss"])         # trained, finite (not NaN, not inf)
    if run == "fsc_clip":        # FSC-CLIP's online rule negatives of the pairs' captions entered its loss
        assert metrics["loss_global_hn"] > 0 and metrics["loss_local_hn"] > 0
    base = load_file(repo / "models" / "base" / "open_clip_model.safetensors")
    tuned = load_file(repo / "models" / run / "open_clip_model.safetensors")
    assert base.keys() == tuned.keys() and any(not base[k].equal(tuned[k]) for k in base)
