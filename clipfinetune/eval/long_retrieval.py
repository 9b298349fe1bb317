"""Long-caption retrieval (DOCCI, DCI, Urban1k, GOAL lists): one caption per image, R@1/5/25/50 both
directions as GOAL's `retrieval_goal.py` (BENCHMARKS §3). Texts go through the model's own tokenizer,
so a Long-CLIP-stretched model sees 248 tokens and a plain one truncates at 77.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from clipfinetune.eval.encode import Encoder, ImageResolver, resolve_image
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.retrieval import RetrievalSet, caption_ids, recall_from_ranks, retrieval_ranks
from clipfinetune.io import InputError

LONG_KS = (1, 5, 25, 50)


def read_docci(path, images_root, split: str = "test", splits=None) -> RetrievalSet:
    """DOCCI `descriptions.jsonlines`: records with split in `splits` (default: just `split`) and example_id
    starting with that split (the HF loader's filter, so qual_test is not in test unless asked for: GOAL's
    DOCCI numbers use test + qual_test, 5,100 images, `splits: [test, qual_test]`); image = images_root/image_file.
    Images keep the file's order."""
    wanted = [split] if splits is None else [splits] if isinstance(splits, str) else list(splits)
    out = RetrievalSet([])
    for n, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("split") in wanted and str(rec.get("example_id", "")).startswith(rec.get("split")):
            if not str(rec.get("description", "")).strip():
                raise InputError(path, rec.get("example_id", n), "empty description")
            out.add(resolve_image(rec["image_file"], images_root, rec["example_id"]), [rec["description"]])
    if not out.images:
        raise InputError(path, None, f"no records of split(s) {wanted}")
    return out


def dci_complete_description(rec: dict) -> str:
    """DCI `get_formatted_complete_description`: short + "\\n" + extra (+ mask captions; quality 2 skipped)."""
    text = rec["short_caption"] + "\n" + rec["extra_caption"]
    masks = []
    for key in rec.get("mask_keys", []):
        m = rec["mask_data"][key]
        if m.get("mask_quality") == 0:
            masks.append(f"{m['label']}: {m['caption']}")
        elif m.get("mask_quality") == 1:
            masks.append(m["label"])
    if masks:
        text += "\nThe following can also be seen in the image:\n" + "\n".join(masks)
    return text


def read_dci(root, split: str = "test", field: str = "extra_caption") -> RetrievalSet:
    """DCI layout `root/{splits.json, complete/<key>, photos/<image>}`; caption = `extra_caption` (what
    GOAL's DCI test file holds) or field == "complete" for DCI's full formatted description."""
    root = Path(root)
    keys = json.loads((root / "splits.json").read_text())[split]
    out = RetrievalSet([])
    for key in keys:
        rec = json.loads((root / "complete" / key).read_text())
        text = dci_complete_description(rec) if field == "complete" else rec[field]
        out.add(resolve_image(rec["image"], root / "photos", key), [text])
    return out


def read_urban1k(root) -> RetrievalSet:
    """Urban1k `root/image/<n>.jpg` + `root/caption/<n>.txt` (caption = first line), ordered by n."""
    root = Path(root)
    files = sorted((root / "caption").glob("*.txt"), key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0, p.stem))
    out = RetrievalSet([])
    for f in files:
        lines = f.read_text().splitlines()
        if not lines or not lines[0].strip():
            raise InputError(f, f.stem, "empty caption file")
        out.add(resolve_image(f.stem + ".jpg", root / "image", f.stem), [lines[0]])
    return out


def read_goal_list(path, images_root) -> RetrievalSet:
    """GOAL `{docci,DCI,urban_dataset}_test.json`: [{"filename", "caption"}], image i <-> caption i.
    The shipped placeholder prefixes are resolved by trailing path under `images_root` (`ImageResolver`: two
    entries landing on one file are an error)."""
    out, resolve = RetrievalSet([]), ImageResolver(path)
    for i, rec in enumerate(json.loads(Path(path).read_text())):
        out.add(resolve(rec["filename"], images_root, i), [rec["caption"]])
    return out


def load_long_set(cfg: dict) -> RetrievalSet:
    """`eval.benchmarks.long_retrieval.<set>`: one of `docci` (+ images), `dci` (root), `urban1k`
    (root), `goal_list` (+ images); optional `split` (`splits` list for DOCCI), `dci_field`."""
    if cfg.get("docci"):
        return read_docci(cfg["docci"], cfg.get("images"), cfg.get("split", "test"), cfg.get("splits"))
    if cfg.get("dci"):
        return read_dci(cfg["dci"], cfg.get("split", "test"), cfg.get("dci_field", "extra_caption"))
    if cfg.get("urban1k"):
        return read_urban1k(cfg["urban1k"])
    if cfg.get("goal_list"):
        return read_goal_list(cfg["goal_list"], cfg.get("images"))
    raise ValueError(f"long_retrieval benchmark needs one of docci|dci|urban1k|goal_list, got {sorted(cfg)}")


def evaluate_long_retrieval(encoder: Encoder, data: RetrievalSet, ks=LONG_KS, items: list | None = None) -> dict:
    if len(set(data.caption_image)) != len(data.caption_image):
        raise ValueError("long-text retrieval expects exactly one caption per image")
    img = encoder.images([(p, None) for p in data.images])
    txt = encoder.texts(data.captions)
    i2t, t2i = retrieval_ranks(img, txt, np.asarray(data.caption_image))
    record(items, Items("i2t", "rank", list(data.images), i2t), Items("t2i", "rank", caption_ids(data), t2i))
    out = recall_from_ranks(i2t, t2i, ks)
    out.update(n_images=len(data.images))
    return out
