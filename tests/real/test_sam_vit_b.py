"""SAM at its real architecture (issue 25), run by `make test-real` (minutes on CPU; `make test` does not collect
tests/real/, see `norecursedirs` in pyproject.toml).

The `segments` stage, in a throw-away copy of the project, with segment-anything's `vit_b` built at random init
(`sam_model_registry["vit_b"]()`), saved as a checkpoint file and loaded by the product (`build_sam`:
`torch.load(weights_only=True)`), on two 1024 x 768 images through `SamAutomaticMaskGenerator` at the stage's
settings (32 x 32 points, predicted-IoU 0.88, stability 0.95); masks -> boxes kept at 1%..80% of the image. Random
weights may give few or no masks above the thresholds: the run must still complete and count every image.
Seconds per image: `python -m benchmarks --only 5` (timing is not tested here)."""
from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from fixtures.project import copy_project, run, write_params
from PIL import Image, ImageDraw

WIDTH, HEIGHT = 1024, 768


def scene(seed: int) -> Image.Image:
    """A grey 1024 x 768 image with a few large flat shapes (plain regions a segmenter could find)."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (WIDTH, HEIGHT), (120, 120, 120))
    draw = ImageDraw.Draw(image)
    for _ in range(4):
        x, y = int(rng.integers(0, WIDTH - 300)), int(rng.integers(0, HEIGHT - 250))
        w, h = int(rng.integers(120, 300)), int(rng.integers(100, 250))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x, y, x + w, y + h], fill=colour)
    return image


@pytest.fixture(scope="module")
def sam_project(tmp_path_factory):
    from segment_anything import sam_model_registry

    repo = copy_project(tmp_path_factory.mktemp("sam") / "project")
    run(repo, "git", "init", "-q")                              # DVC reads params in a git workspace
    torch.manual_seed(0)
    sam = sam_model_registry["vit_b"]()                         # the real vit_b, random weights
    checkpoint = repo / "weights" / "sam_vit_b_random.pth"
    checkpoint.parent.mkdir()
    torch.save(sam.state_dict(), checkpoint)
    images = repo / "docci_real" / "images"
    images.mkdir(parents=True)
    records = []
    for i in range(2):
        scene(i).save(images / f"real_{i}.png")
        records.append({"example_id": f"real_{i}", "split": "test", "image_file": f"real_{i}.png",
                        "description": "Shapes on grey."})
    docci = repo / "docci_real" / "descriptions.jsonlines"
    docci.write_text("".join(json.dumps(r) + "\n" for r in records))
    write_params(repo, {"sources": {"docci": {"reader": "docci", "descriptions": str(docci), "images": str(images)}},
                        "segments": {"sources": ["docci"], "sam_checkpoint": str(checkpoint), "sam_type": "vit_b"}})
    return repo, sam, checkpoint


def test_product_loads_the_vit_b_checkpoint_weights_only(sam_project):
    from segment_anything.modeling import Sam

    from clipfinetune.data.prepare.segments import build_sam

    _, sam, checkpoint = sam_project
    loaded = build_sam("vit_b", str(checkpoint))
    assert isinstance(loaded, Sam) and not loaded.training
    assert len(loaded.image_encoder.blocks) == 12 and loaded.image_encoder.img_size == 1024
    theirs = loaded.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in sam.state_dict().items())


def test_segments_stage_with_real_vit_b_on_1024_images(sam_project):
    repo, _, checkpoint = sam_project
    run(repo, sys.executable, "stages/segments.py", "--stage", "segments@docci")
    meta = json.loads((repo / "data" / "prepared" / "segments.meta.json").read_text())
    assert meta["segmenter"] == f"segment-anything vit_b ({checkpoint})"
    assert meta["n_images"] == 2 and meta["skipped"] == []
    table = pd.read_parquet(repo / "data" / "prepared" / "segments.parquet")
    assert meta["n_segments"] == len(table)
    assert meta["images_without_segments"] + table["image_id"].nunique() == 2      # every image counted
    assert set(table["image_id"]) <= {"real_0", "real_1"}
    assert table["area_frac"].between(0.01, 0.8).all()
    assert (table["x0"] >= 0).all() and (table["x1"] <= WIDTH).all() and (table["x0"] < table["x1"]).all()
    assert (table["y0"] >= 0).all() and (table["y1"] <= HEIGHT).all() and (table["y0"] < table["y1"]).all()
