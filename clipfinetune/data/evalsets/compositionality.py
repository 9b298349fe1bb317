"""Compositionality sets (docs/evalsets.md §4): SugarCrepe, ARO VG-Relation / VG-Attribution, VALSE, Winoground, each
read as its official release lays it out (the evaluation is `clipfinetune.eval.compositionality`)."""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.data.evalsets.images import resolve_image
from clipfinetune.io import InputError

SUGARCREPE_TASKS = ("replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att")


# ---------------------------------------------------------------- SugarCrepe
def read_sugarcrepe(directory, images_root) -> dict[str, list[dict]]:
    """{task: [{image, caption, negative_caption}]} for each of the seven files present (dict keyed by
    possibly non-contiguous string ids, kept in file order)."""
    out = {}
    for task in SUGARCREPE_TASKS:
        f = Path(directory) / f"{task}.json"
        if not f.is_file():
            continue
        recs = []
        for key, r in json.loads(f.read_text()).items():
            recs.append({"id": str(key), "image": resolve_image(r["filename"], images_root, f"{task}:{key}"),
                         "caption": r["caption"], "negative_caption": r["negative_caption"]})
        out[task] = recs
    if not out:
        raise InputError(directory, None, f"no SugarCrepe files ({', '.join(SUGARCREPE_TASKS)}.json)")
    return out


# ---------------------------------------------------------------- ARO VG-Relation / VG-Attribution
def _vg_cases(path, images_root):
    recs = json.loads(Path(path).read_text())
    keys = []
    for i, r in enumerate(recs):
        x, y, w, h = (float(r[k]) for k in ("bbox_x", "bbox_y", "bbox_w", "bbox_h"))
        keys.append((resolve_image(r["image_path"], images_root, i), (x, y, x + w, y + h)))
    return recs, keys


def read_vg(directory, images_root) -> dict[str, tuple]:
    """{"vg_relation" | "vg_attribution": `_vg_cases` of that ARO file} for the files present in `directory`."""
    files = {"vg_relation": "visual_genome_relation.json", "vg_attribution": "visual_genome_attribution.json"}
    return {part: _vg_cases(Path(directory) / name, images_root) for part, name in files.items()
            if (Path(directory) / name).is_file()}


# ---------------------------------------------------------------- VALSE
def read_valse(directory, images) -> dict[str, list[dict]]:
    """{piece: valid samples}; valid = mturk.caption >= 2 (VALSE README). `images` is one root or a
    {piece or sample "dataset": root} mapping (the pieces come from different image sources)."""
    out = {}
    for f in sorted(Path(directory).glob("*.json")):
        valid = []
        for key, s in json.loads(f.read_text()).items():
            if int((s.get("mturk") or {}).get("caption", 0)) < 2:
                continue
            root = images.get(f.stem) or images.get(s.get("dataset")) if isinstance(images, dict) else images
            valid.append({"id": str(key), "image": resolve_image(s["image_file"], root, f"{f.stem}:{key}"),
                          "caption": s["caption"], "foil": s["foil"]})
        out[f.stem] = valid
    if not out:
        raise InputError(directory, None, "no VALSE piece files (*.json)")
    return out


# ---------------------------------------------------------------- Winoground
WINOGROUND_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


def winoground_image(directory: Path, name: str, record) -> str:
    """The released `examples.jsonl` names images by stem ("ex_0_img_0"), files in `images/<stem>.png`;
    a name with an extension is taken as given. Looked up in `images/`, then beside the jsonl."""
    names = [name] if Path(name).suffix.lower() in WINOGROUND_IMAGE_SUFFIXES else \
        [name + s for s in WINOGROUND_IMAGE_SUFFIXES] + [name]
    tried = []
    for root in (directory / "images", directory):
        for n in names:
            tried.append(root / n)
            if tried[-1].is_file():
                return str(tried[-1])
    raise InputError(tried[0], record, f"Winoground image not found (also tried {[str(p) for p in tried[1:]]})")


def read_winoground(directory) -> list[dict]:
    """Released form: `examples.jsonl` ({id, caption_0, caption_1, image_0, image_1 (stems without extension),
    tag, ...}) with the images in `images/<stem>.png`; without image_k the fixture name `ex_<id>_img_<k>`."""
    d = Path(directory)
    f = d / "examples.jsonl"
    if not f.is_file():
        raise InputError(f, None, "Winoground examples.jsonl not found")
    out = []
    for line in f.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        imgs = [r.get(f"image_{k}") if isinstance(r.get(f"image_{k}"), str) else f"ex_{r['id']}_img_{k}"
                for k in (0, 1)]
        out.append({"id": str(r["id"]), "images": [winoground_image(d, i, r["id"]) for i in imgs],
                    "captions": [r["caption_0"], r["caption_1"]]})
    return out
