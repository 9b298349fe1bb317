"""`read_set`: which reader each task of params `eval.evalsets` uses, and what a configured set reads on disk
(`evalset_files`, `evalset_manifest`: stage `evalsets`, on which every eval@<model> depends)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clipfinetune.data.evalsets import (
    box_cls,
    compositionality,
    global_local,
    long_retrieval,
    retrieval,
    zeroshot,
)
from clipfinetune.digests import DigestCache
from clipfinetune.io import InputError

ARO_ORDERS = ("coco_order", "flickr_order")


@dataclass(frozen=True)
class EvalSet:
    """One configured set as its benchmark's own reader gives it: `data` for the task's evaluator, `images` every image
    file it scores."""
    data: Any
    images: list[str]


def read_set(task: str, cfg: dict, name: str = "") -> EvalSet:
    """Read one configured set (`eval.evalsets.<task>.<name>`) with its benchmark's reader: the one place that says
    which reader each task uses. The evaluation (`clipfinetune.eval.suite`), the leakage check
    (`clipfinetune.leakage`) and the evaluation-set manifest (`evalset_files`) all read sets through it, so they see the
    same files."""
    if task == "retrieval":
        data = retrieval.load_retrieval_set(cfg)
        return EvalSet(data, data.images)
    if task == "long_retrieval":
        data = long_retrieval.load_long_set(cfg)
        return EvalSet(data, data.images)
    if task == "global_local":
        data = global_local.read_joint_list(cfg["test_list"], cfg.get("images"))
        return EvalSet(data, [r.image[0] for r in data])
    if task in ("box_cls", "box_cls_hard"):
        data = box_cls.load_box_set(cfg)
        return EvalSet(data, [p for p, _ in data.images])
    if task in ("sugarcrepe", "valse"):
        read = compositionality.read_sugarcrepe if task == "sugarcrepe" else compositionality.read_valse
        data = read(cfg["dir"], cfg.get("images"))
        return EvalSet(data, [r["image"] for recs in data.values() for r in recs])
    if task == "winoground":
        data = compositionality.read_winoground(cfg["dir"])
        return EvalSet(data, [p for r in data for p in r["images"]])
    if task == "zeroshot":           # a multi-dataset templates.json is keyed by the set's name
        data = zeroshot.read_image_folder(cfg["dir"], cfg.get("split", "test"), cfg.get("templates_key", name))
        return EvalSet(data, data.images)
    if task == "aro":
        data = {}
        if cfg.get("dir"):
            data["vg"] = compositionality.read_vg(cfg["dir"], cfg.get("images") or str(Path(cfg["dir"]) / "images"))
        data.update({order: retrieval.read_blip_list(cfg[order], cfg.get(f"{order}_images"))
                     for order in ARO_ORDERS if cfg.get(order)})
        images = [p for _, keys in data.get("vg", {}).values() for p, _ in keys]
        return EvalSet(data, images + [p for order in ARO_ORDERS if order in data for p in data[order].images])
    raise ValueError(f"unknown evaluation task {task!r}")


def _is_image_root(key: str) -> bool:
    return key == "images" or key.endswith("_images")


def evalset_files(task: str, cfg: dict, name: str = "") -> list[str]:
    """Every file one configured set reads: the images its reader scores (`read_set`), and each configured path that is
    not an image root (`images`, `<x>_images`): an annotation file, or every file under an annotation folder
    (SugarCRepe's `dir`, ARO's, a zero-shot folder's class names and templates). Image files under such a folder count
    only when scored, so a zero-shot folder's other splits or ARO's unused images are not read."""
    scored = [os.path.normpath(p) for p in read_set(task, cfg, name).images]
    files, scored_set = set(scored), set(scored)
    for key, value in cfg.items():
        if _is_image_root(key) or not isinstance(value, str) or not value:
            continue
        path = Path(value)
        if path.is_file():
            files.add(os.path.normpath(value))
        elif path.is_dir():
            for f in path.rglob("*"):
                p = os.path.normpath(f)
                if f.is_file() and (f.suffix.lower() not in zeroshot.IMAGE_EXTS or p in scored_set):
                    files.add(p)
    return sorted(files)


def evalset_manifest(evalsets: dict | None, cache_dir=None) -> tuple[dict, dict]:
    """({"<task>.<set>": {file: [size, BLAKE2b]}} for every configured set of `eval.evalsets`, what it cost:
    {"files", "bytes", "files_hashed", "digests_reused"}). Digests are cached by (path, size, mtime) in
    `<cache_dir>/digests.sqlite` (`clipfinetune.digests.DigestCache`, shared with the leakage check), so an unchanged
    set costs one stat per file. A set whose files are missing is an error naming the file."""
    sets: dict[str, dict] = {}
    cache = DigestCache(cache_dir)
    try:
        for task, by_set in sorted((evalsets or {}).items()):
            for name, cfg in sorted((by_set or {}).items()):
                if not cfg:
                    continue
                entry = sets[f"{task}.{name}"] = {}
                for path in evalset_files(task, dict(cfg), name):
                    try:
                        st = os.stat(path)
                    except OSError as e:
                        raise InputError(path, f"eval.evalsets.{task}.{name}", f"cannot read: {e}") from e
                    entry[path] = [st.st_size, cache.digest(path, st)]
        cost = {"files": sum(len(e) for e in sets.values()),
                "bytes": sum(size for e in sets.values() for size, _ in e.values()),
                "files_hashed": cache.hashed, "digests_reused": cache.reused}
    finally:
        cache.close()
    return sets, cost
