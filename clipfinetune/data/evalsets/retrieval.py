"""Image-text retrieval sets (COCO Karpathy 5K, Flickr30k 1K, docs/evalsets.md §1.6, §1.7, §2): one reader per format in
circulation -> `RetrievalSet` (the evaluation is `clipfinetune.eval.retrieval`)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from clipfinetune.data.evalsets.images import resolve_image
from clipfinetune.data.readers import coco, karpathy
from clipfinetune.io import InputError


@dataclass
class RetrievalSet:
    images: list[str]                                  # resolved image paths
    captions: list[str] = field(default_factory=list)
    caption_image: list[int] = field(default_factory=list)   # caption j belongs to image caption_image[j]

    def add(self, image: str, captions) -> None:
        if not captions:
            raise InputError(image, None, "image has no captions")
        self.images.append(image)
        self.captions.extend(str(c) for c in captions)
        self.caption_image.extend([len(self.images) - 1] * len(captions))


def read_karpathy(path, images_root, split: str = "test") -> RetrievalSet:
    """Karpathy (`readers.karpathy`): the images of `split` with their raw sentences; image path =
    images_root/filepath/filename (filepath absent for Flickr30k)."""
    out = RetrievalSet([])
    for r in karpathy.read(path, images_root, splits=[split]):
        out.add(resolve_image(r.image, images_root, r.image_id), list(r.captions))
    return out


def read_blip_list(path, images_root) -> RetrievalSet:
    """BLIP/ALBEF/ARO `coco_karpathy_test.json` / `flickr30k_test.json`: [{"image", "caption": [..]}]."""
    out = RetrievalSet([])
    for i, rec in enumerate(json.loads(Path(path).read_text())):
        caps = rec["caption"] if isinstance(rec["caption"], list) else [rec["caption"]]
        out.add(resolve_image(rec["image"], images_root, i), caps)
    return out


def read_flickr_txt(path, images_root) -> RetrievalSet:
    """CLIP_benchmark `flickr30k_{split}_karpathy.txt`: header line, then `<name>.jpg,<caption>` split on
    the literal ".jpg," (captions may contain commas); images in order of first appearance."""
    groups: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines()[1:]:
        if not line.strip():
            continue
        if ".jpg," not in line:
            raise InputError(path, line, "expected '<name>.jpg,<caption>'")
        name, cap = line.split(".jpg,", 1)
        groups.setdefault(name + ".jpg", []).append(cap)
    out = RetrievalSet([])
    for name, caps in groups.items():
        out.add(resolve_image(name, images_root, name), caps)
    return out


def read_flickr_token(path, images_root, names=None) -> RetrievalSet:
    """Original `results_20130124.token`: `<name>.jpg#<k>\\t<caption>`; `names` restricts to a split
    (Long-CLIP evaluates the whole file; pass the 1K test names to get the Karpathy test)."""
    groups: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        key, _, cap = line.partition("\t")
        name = key.split("#")[0]
        if names is None or name in names:
            groups.setdefault(name, []).append(cap.strip())
    out = RetrievalSet([])
    for name, caps in groups.items():
        out.add(resolve_image(name, images_root, name), caps)
    return out


def read_coco_captions(path, images_root) -> RetrievalSet:
    """A COCO captions file (e.g. `captions_val2017.json`, HarmoCLIP's retrieval set), read by `readers.coco`: its
    images with captions, by id, captions in file order (the reader's caption_index); image = images_root/file_name."""
    out = RetrievalSet([])
    for r in coco.read(path, images_root or ""):
        out.add(resolve_image(r.image, images_root, r.image_id), list(r.captions))
    return out


def load_retrieval_set(cfg: dict) -> RetrievalSet:
    """One benchmark entry of `eval.evalsets.retrieval.<set>`: exactly one of
    `karpathy` | `coco_captions` | `blip` | `flickr_txt` | `flickr_token`, plus `images` (and optional `split`)."""
    root = cfg.get("images")
    if cfg.get("karpathy"):
        return read_karpathy(cfg["karpathy"], root, cfg.get("split", "test"))
    if cfg.get("coco_captions"):
        return read_coco_captions(cfg["coco_captions"], root)
    if cfg.get("blip"):
        return read_blip_list(cfg["blip"], root)
    if cfg.get("flickr_txt"):
        return read_flickr_txt(cfg["flickr_txt"], root)
    if cfg.get("flickr_token"):
        return read_flickr_token(cfg["flickr_token"], root)
    raise ValueError(f"retrieval benchmark needs one of karpathy|coco_captions|blip|flickr_txt|flickr_token, "
                     f"got {sorted(cfg)}")
