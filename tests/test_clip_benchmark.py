"""CLIP_benchmark reads our exports (issue 25): `clip_benchmark eval` on a model written by `export_model`, over a
small local zero-shot set in CLIP_benchmark's own `wds/` layout (written by its `convert_dataset`), gives the numbers
of our `eval/zeroshot.py` on the same images, class names and templates.

Protocols: CLIP_benchmark preprocesses with `open_clip.create_model_and_transforms`, which follows the export's
`preprocess_cfg`; ours records `resize_mode: squash` (the transform the model trained with), so both squash-resize,
and the images can be non-square. Mixed precision is off (`--no_amp`), as our evaluation runs fp32 on CPU."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.methods import random_image, tiny_model
from PIL import ImageDraw

from clipfinetune.data.evalsets.zeroshot import read_image_folder
from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.zeroshot import evaluate_zeroshot
from clipfinetune.models import export_model, load_model

# `clip_benchmark eval`, with the one-line fix of LAION-AI/CLIP_benchmark#147 (open): its `accuracy` calls float()
# on a 1-element array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted").
CLIP_BENCHMARK_EVAL = """
import sys
import clip_benchmark.metrics.zeroshot_classification as zeroshot

def accuracy(output, target, topk=(1,)):
    pred = output.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [float(correct[:k].reshape(-1).float().sum()) / len(target) for k in topk]

zeroshot.accuracy = accuracy
from clip_benchmark.cli import main
sys.argv = ["clip_benchmark", "eval", *sys.argv[1:]]
main()
"""
CLASSES = ["red circle", "green square", "blue triangle", "yellow star", "white ring", "black cross"]
COLOURS = ["red", "green", "blue", "yellow", "white", "black"]
TEMPLATES = ["a photo of a {c}.", "a drawing of a {c}."]


class ImagePaths:
    """(path, label) pairs with `classes` and `templates`, as `clip_benchmark.webdataset_builder.convert_dataset`
    takes them (with `transform=path_to_bytes`, the files are copied as they are)."""

    def __init__(self, items, classes, templates):
        self.items, self.classes, self.templates = items, classes, templates

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def zeroshot_folder(root: Path) -> Path:
    """Our zero-shot layout: test/<class>/*.png, classnames.txt, templates.txt; non-square images, 6 per class."""
    for c, (name, colour) in enumerate(zip(CLASSES, COLOURS)):
        folder = root / "test" / f"{c}_{name.replace(' ', '_')}"
        folder.mkdir(parents=True)
        for i in range(6):
            image = random_image(100 * c + i, 90 + 10 * i, 60)
            ImageDraw.Draw(image).ellipse([10, 10, 50, 50], fill=colour)
            image.save(folder / f"{i}.png")
    (root / "classnames.txt").write_text("\n".join(CLASSES) + "\n")
    (root / "templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return root


@pytest.mark.timeout(300)
def test_clip_benchmark_eval_of_our_export_equals_our_zeroshot(tmp_path):
    from clip_benchmark.webdataset_builder import convert_dataset, path_to_bytes

    export = export_model(tiny_model(), tmp_path / "export")
    ours_data = read_image_folder(zeroshot_folder(tmp_path / "zs"))
    ours = evaluate_zeroshot(Encoder(load_model(f"local-dir:{export}"), batch_size=8), ours_data)

    wds_root = tmp_path / "wds"
    convert_dataset(ImagePaths(list(zip(ours_data.images, ours_data.labels)), ours_data.classnames, TEMPLATES),
                    "test", str(wds_root), transform=path_to_bytes, verbose=False)
    out = tmp_path / "clip_benchmark.json"
    command = [sys.executable, "-c", CLIP_BENCHMARK_EVAL, "--model", f"local-dir:{export}",
               "--pretrained", "", "--dataset", "wds/shapes", "--dataset_root", str(wds_root),
               "--task", "zeroshot_classification", "--batch_size", "8", "--num_workers", "0", "--no_amp",
               "--output", str(out)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(out.read_text())
    assert theirs["dataset"] == "wds/shapes" and theirs["model"] == f"local-dir:{export}"
    metrics = theirs["metrics"]
    assert ours["n_images"] == 36 and ours["n_classes"] == 6        # 6 classes: top-5 is not trivially 100
    assert math.isclose(100 * metrics["acc1"], ours["acc1"], abs_tol=1e-6)
    assert math.isclose(100 * metrics["acc5"], ours["acc5"], abs_tol=1e-6)
    assert math.isclose(100 * metrics["mean_per_class_recall"], ours["mean_per_class"], abs_tol=1e-6)
