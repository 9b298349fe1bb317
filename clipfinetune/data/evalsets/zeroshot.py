"""Zero-shot classification sets, open_clip / CLIP_benchmark layout (docs/evalsets.md §6) -> `ZeroShotSet` (the
evaluation is `clipfinetune.eval.zeroshot`).

Layout: `<dir>/test/<class folder>/*.{jpg,png,...}` (ImageFolder: class index = sorted folder names),
`<dir>/classnames.txt` (line i = name of class i; default: the folder names) and templates in
`<dir>/templates.txt` (one per line, `{c}` or `{}` placeholder) or `<dir>/templates.json`
(CLIP_benchmark's multi-dataset file {"<dataset>": [...], ...}: the entry named by the set's `templates_key`,
default the set's name, else an error; or a plain list); default: "a photo of a {c}.".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
