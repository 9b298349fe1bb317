"""Zero-shot classification, open_clip / CLIP_benchmark style (BENCHMARKS §6).

Layout: `<dir>/test/<class folder>/*.{jpg,png,...}` (ImageFolder: class index = sorted folder names),
`<dir>/classnames.txt` (line i = name of class i; default: the folder names) and templates in
`<dir>/templates.txt` (one per line, `{c}` or `{}` placeholder) or `<dir>/templates.json`
(CLIP_benchmark's multi-dataset file {"<dataset>": [...], ...}: the entry named by the set's `templates_key`,
default the set's name, else an error; or a plain list); default: "a photo of a {c}.".
Classifier: per class, mean of the normalised template embeddings, renormalised (open_clip
`build_zero_shot_classifier`). Metrics: acc1, acc5 (null with < 5 classes, as CLIP_benchmark's NaN),
mean_per_class = mean per-class recall over classes present (sklearn `balanced_accuracy_score`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clipfinetune.eval.encode import Encoder, text_classifier
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.ranking import mean_per_class, topk_hits
from clipfinetune.io import InputError

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff", ".ppm", ".pgm"}


@dataclass
class ZeroShotSet:
    images: list[str]
    labels: list[int]
    classnames: list[str]
    templates: list[str]


def read_templates(directory: Path, key: str | None = None) -> list[str]:
    """`key`: the dataset whose entry a multi-dataset templates.json gives (CLIP_benchmark names, e.g. "cifar10")."""
    if (directory / "templates.txt").is_file():
        t = [ln.strip() for ln in (directory / "templates.txt").read_text().splitlines() if ln.strip()]
    elif (directory / "templates.json").is_file():
        f = directory / "templates.json"
        data = json.loads(f.read_text())
        if isinstance(data, dict):
            if key not in data:
                raise InputError(f, key, f"no templates for dataset {key!r} (the file has {sorted(data)[:8]}"
                                         f"{' ...' if len(data) > 8 else ''}); set `templates_key`")
            t = data[key]
        else:
            t = data
    else:
        t = ["a photo of a {c}."]
    bad = [x for x in t if "{c}" not in x and "{}" not in x]
    if bad:
        raise InputError(directory / "templates", bad[0], "template without a {c} / {} placeholder")
    return list(t)


def read_image_folder(directory, split: str = "test", templates_key: str | None = None) -> ZeroShotSet:
    d = Path(directory)
    root = d / split if (d / split).is_dir() else d
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    if not folders:
        raise InputError(root, None, "no class folders")
    images, labels = [], []
    for i, f in enumerate(folders):
        files = sorted(p for p in f.iterdir() if p.suffix.lower() in IMAGE_EXTS)
        images += [str(p) for p in files]
        labels += [i] * len(files)
    names_file = d / "classnames.txt"
    if names_file.is_file():
        names = [ln.strip() for ln in names_file.read_text().splitlines() if ln.strip()]
        if len(names) != len(folders):
            raise InputError(names_file, None, f"{len(names)} class names for {len(folders)} class folders")
    else:
        names = [f.name.replace("_", " ") for f in folders]
    return ZeroShotSet(images, labels, names, read_templates(d, templates_key))


def zeroshot_metrics(logits, labels, hits: dict | None = None) -> dict:
    """`hits`, when given, receives the per-image hit arrays {"top1": [N] bool, "top5": ...}."""
    labels = np.asarray(labels)
    hits = {} if hits is None else hits
    top1 = hits["top1"] = topk_hits(logits, labels, 1)
    out = {"acc1": 100.0 * float(top1.mean()), "mean_per_class": mean_per_class(top1, labels), "acc5": None}
    if logits.shape[1] >= 5:
        hits["top5"] = topk_hits(logits, labels, 5)
        out["acc5"] = 100.0 * float(hits["top5"].mean())
    return out


def evaluate_zeroshot(encoder: Encoder, data: ZeroShotSet, items: list | None = None) -> dict:
    """Items: parts top1 / top5 (hit per image, id = its path), labelled `<class index>:<class name>`."""
    w = text_classifier(encoder, data.classnames, data.templates)          # [C, D], unit rows
    img = encoder.images([(p, None) for p in data.images])
    hits: dict = {}
    out = zeroshot_metrics((img @ w.T).numpy(), data.labels, hits)
    names = [f"{c}:{data.classnames[c]}" for c in data.labels]
    record(items, *(Items(part, "correct", list(data.images), h, names) for part, h in hits.items()))
    out.update(n_images=len(data.images), n_classes=len(data.classnames))
    return out
