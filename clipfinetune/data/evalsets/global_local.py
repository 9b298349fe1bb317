"""GOAL's joint global+local test list (docs/evalsets.md §7.1): the one reader and the one writer of its format.

The `lism` stage writes it (`write_items` inside its work units, `place_files` and `write_test_list` when rank 0
assembles them); the evaluation (`eval.global_local`, through `data.evalsets.sets.read_set`) reads it back
(`read_joint_list`), as do the leakage check and the evaluation-set manifest. Below all of them, so LISM never
depends on the evaluation's code.

The list: every global record first, `{filename: photos/<name>, caption: <long caption>}`, then one local record per
image, `{filename: segments/<name>_results/<crop>, caption: <sentence>, similarity_score}`; paths relative to the
list's folder. A record is local when its parent folder ends in `_results` (or it says `"kind": "local"`). Group
id: a global's file stem; a local's parent folder minus `_results` and the extension. A local crop file that is
absent may be given as a box on its global image instead (`box` xyxy or GOAL's `bbox_coordinates` {x1, y1, x2, y2},
original pixels).

Files (`write_items`): the global image is the source's original file, hard-linked (copied where a link cannot
be made, e.g. across file systems; written from the bytes for a source that stores them): byte-identical, never
re-encoded, so the list scores the very pixels GOAL's list names, and a link costs no disk. DVC's cache links the
outputs here (.dvc/config `cache.type: hardlink,symlink`), so a linked original becomes part of the cache object
of the same inode, which DVC marks read-only: the dataset's file is then read-only too, and nothing is stored
twice (a copy is stored once more, unless the dataset is itself tracked by DVC: the same content hash). The local
item is the chosen segment's crop as a PNG (`<stem>_max_<candidate>.png`, lossless, as GOAL writes it), or, when
the global image wins, the original again as `original_image<suffix>` (GOAL's 211/1,999).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from clipfinetune.data.evalsets.images import AmbiguousImageName, ImageResolver
from clipfinetune.io import InputError, atomic_path

PHOTOS, SEGMENTS = "photos", "segments"


@dataclass
class JointRecord:
    image: tuple          # (path, crop box or None)
    caption: str
    group: str
    is_local: bool


# ------------------------------------------------------------------------------------------------ reading
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


# ------------------------------------------------------------------------------------------------ writing
def item_names(image_id: str, image_name: str, candidate: int) -> tuple[str, str]:
    """(global file, local file) of one image's two items, relative to the list's folder. `candidate`: the chosen
    segment (r >= 1) or 0, the global image itself."""
    suffix = Path(image_name).suffix or ".jpg"
    name = image_id.replace("/", "_") + suffix
    results = f"{SEGMENTS}/{name}_results"
    local = f"{results}/{Path(name).stem}_max_{candidate}.png" if candidate else f"{results}/original_image{suffix}"
    return f"{PHOTOS}/{name}", local


def link_or_copy(src, dst) -> None:
    """`dst` made the same file as `src` (a hard link, else a byte copy), atomically; an existing `dst` replaced."""
    dst = Path(dst)
    with atomic_path(dst) as tmp:
        try:
            os.link(src, tmp)
        except OSError:                  # another file system, or links not allowed
            shutil.copyfile(src, tmp)


def _original(record, dst: Path) -> None:
    if record.data is not None:         # a source that stores the bytes (WebDataset): those bytes
        with atomic_path(dst) as tmp:
            tmp.write_bytes(record.data)
    else:
        link_or_copy(record.path, dst)


def write_items(record, sentence: str, candidate: int, box, score: float, out_dir) -> tuple[dict, dict]:
    """One image's two items of the list, with their files written under `out_dir` (module docstring): the
    original image with `record.long_caption`, and the local item (the crop `box` of segment `candidate`, or the
    original when `candidate` is 0) with `sentence`. `record`: a `readers.Record`."""
    out_dir = Path(out_dir)
    global_name, local_name = item_names(record.image_id, record.image, candidate)
    (out_dir / local_name).parent.mkdir(parents=True, exist_ok=True)
    (out_dir / global_name).parent.mkdir(parents=True, exist_ok=True)
    _original(record, out_dir / global_name)
    if candidate:
        crop = record.read_image().crop(tuple(round(v) for v in box))
        with atomic_path(out_dir / local_name) as tmp:
            crop.save(tmp, format="PNG")
    else:
        _original(record, out_dir / local_name)
    return ({"filename": global_name, "caption": record.long_caption, "image_id": record.image_id},
            {"filename": local_name, "caption": sentence, "similarity_score": round(score, 4),
             "image_id": record.image_id})


def place_files(items: list[tuple[dict, dict]], from_dir, to_dir) -> None:
    """Every file the items name, from `from_dir` (where `write_items` wrote them) into `to_dir` (linked)."""
    for pair in items:
        for item in pair:
            dst = Path(to_dir) / item["filename"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(Path(from_dir) / item["filename"], dst)


def write_test_list(test_dir, items: list[tuple[dict, dict]]) -> None:
    """GOAL's joint list `test.json`: every global item first, then one local item per image (what
    `read_joint_list` reads back)."""
    globals_, locals_ = zip(*items) if items else ((), ())
    (Path(test_dir) / "test.json").write_text(json.dumps([*globals_, *locals_], indent=1))
