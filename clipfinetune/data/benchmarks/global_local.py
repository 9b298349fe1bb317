"""GOAL's joint test list (BENCHMARKS §7.1, written by the `lism` stage) -> `JointRecord`s: the reader the
evaluation (`clipfinetune.eval.global_local`), the leakage check and the benchmark manifest share.

Global records `{filename, caption}` and local records `{filename: ".../<stem>.jpg_results/<crop>.png", caption:
<sentence>, similarity_score}`. A record is local when its parent folder ends in `_results` (or it says
`"kind": "local"`). Group id: a global's file stem; a local's parent folder minus `_results` and the extension.
A local crop file that is absent may be given as a box on its global image instead (`box` xyxy or GOAL's
`bbox_coordinates` {x1, y1, x2, y2}, original pixels).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from clipfinetune.data.benchmarks.images import AmbiguousImageName, ImageResolver
from clipfinetune.io import InputError


@dataclass
class JointRecord:
    image: tuple          # (path, crop box or None)
    caption: str
    group: str
    is_local: bool


def _is_local(rec: dict) -> bool:
    if "kind" in rec:
        return rec["kind"] == "local"
    return Path(rec["filename"]).parent.name.endswith("_results")


def group_id(rec: dict) -> str:
    p = Path(rec["filename"])
    if _is_local(rec):
        name = p.parent.name
        name = name.removesuffix("_results")
        return rec.get("group") or Path(name).stem
    return rec.get("group") or p.stem


def _local_box(rec: dict):
    if rec.get("box") is not None:
        return [float(v) for v in rec["box"]]
    b = rec.get("bbox_coordinates")
    if b:
        return [float(b["x1"]), float(b["y1"]), float(b["x2"]), float(b["y2"])]
    return None


def _resolve_first(resolve: ImageResolver, name: str, roots, record) -> str | None:
    for root in roots:
        try:
            return resolve(name, root, record)
        except AmbiguousImageName:
            raise
        except InputError:
            pass
    return None


def read_joint_list(path, images_root) -> list[JointRecord]:
    """Paths resolve against the list's folder first (the `lism` stage writes them relative to it), then
    `images_root` (also by basename, for GOAL's shipped placeholder prefixes)."""
    raw = json.loads(Path(path).read_text())
    base = Path(path).parent
    resolve = ImageResolver(path)
    globals_: dict[str, str] = {}
    for i, rec in enumerate(raw):
        if not _is_local(rec):
            found = _resolve_first(resolve, rec["filename"], (base, images_root), i)
            if found is None:
                raise InputError(path, i, f"global image {rec['filename']!r} not found under {base} or {images_root}")
            globals_[group_id(rec)] = found
    out = []
    for i, rec in enumerate(raw):
        g, local = group_id(rec), _is_local(rec)
        if not local:
            out.append(JointRecord((globals_[g], None), rec["caption"], g, False))
            continue
        if g not in globals_:
            raise InputError(path, i, f"local record of group {g!r} has no global record")
        found = _resolve_first(resolve, rec["filename"], (base, images_root), i)
        image = (found, None) if found else None
        if image is None:
            box = _local_box(rec)
            if box is None:
                raise InputError(path, i, f"local crop {rec['filename']!r} not found and no box given")
            image = (globals_[g], box)
        out.append(JointRecord(image, rec["caption"], g, True))
    return out
