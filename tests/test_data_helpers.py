"""Tiny worlds for the data tests (no tests here): COCO instances/captions, DOCCI, prepared parquet files,
and a stand-in Method. Everything expected is written down here by hand, never computed by the code under test."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from PIL import Image


def jpeg(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def coco_pair(images: list[dict], anns: list[dict], caps: list[tuple[int, str]], categories: list[str]):
    """instances + captions dicts; caps = [(image_id, caption)], caption ids in order from 1."""
    cats = [{"id": i + 1, "name": n, "supercategory": "x"} for i, n in enumerate(categories)]
    for k, a in enumerate(anns, 1):
        a.setdefault("id", k)
        a.setdefault("iscrowd", 0)
    inst = {"images": images, "annotations": anns, "categories": cats}
    capj = {"images": images, "annotations": [{"id": k, "image_id": i, "caption": c}
                                               for k, (i, c) in enumerate(caps, 1)]}
    return inst, capj


def img(i: int, w: int = 100, h: int = 80) -> dict:
    return {"id": i, "file_name": f"{i:012d}.jpg", "width": w, "height": h}


class World:
    """A tiny COCO + DOCCI world on disk with its prepared parquet files (as other stages would write them)."""

    def __init__(self, root: Path, n_coco: int = 24, n_docci: int = 12):
        self.root = root
        (root / "coco").mkdir(parents=True)
        (root / "docci").mkdir()
        (root / "prepared").mkdir()
        images, caps, wr, neg = [], [], [], []
        for i in range(1, n_coco + 1):
            w, h = 40 + i, 30 + (i % 5)
            images.append(img(i, w, h))
            (root / "coco" / f"{i:012d}.jpg").write_bytes(jpeg(w, h, i))
            c0, c1 = f"A red circle number {i}.", f"Two squares and a circle {i}."
            caps += [(i, c0), (i, c1)]
            wr.append({"image_id": i, "caption_id": 2 * i - 1, "caption_index": 0, "caption": c0, "word": "circle",
                       "char_start": 6, "char_end": 12, "category": "circle", "category_id": 1,
                       "x0": 1.0, "y0": 2.0, "x1": 11.0, "y1": 12.0})
            neg += [{"image_id": str(i), "caption_index": 1, "caption": c1, "type": "swap_nouns",
                     "negative": f"Two circles and a square {i}."},
                    {"image_id": str(i), "caption_index": 1, "caption": c1, "type": "swap_nouns",
                     "negative": f"A circle and two squares {i}."}]
        self.instances, self.captions = coco_pair(images, [], caps, ["circle", "square"])
        (root / "captions.json").write_text(json.dumps(self.captions))
        docci, sents, pairs = [], [], []
        for j in range(n_docci):
            eid = f"train_{j:05d}"
            long = f"A blue star on grass. It is 3.5 cm wide. Dr. Who drew it {j}."
            docci.append({"example_id": eid, "split": "train", "image_file": f"{eid}.jpg", "description": long})
            (root / "docci" / f"{eid}.jpg").write_bytes(jpeg(50, 40, 1000 + j))
            for k, (s, e) in enumerate([(0, 21), (22, 40), (41, len(long))]):
                sents.append({"image_id": eid, "source": "docci", "long_caption": long, "sentence_index": k,
                              "text": long[s:e], "char_start": s, "char_end": e})
            pairs.append({"image_id": eid, "sentence_index": 1, "x0": 5.0, "y0": 6.0, "x1": 25.0, "y1": 30.0,
                          "score": 0.9, "chosen": j % 3 != 2, "kind": "region" if j % 3 == 0 else "global"})
        docci.append({"example_id": "test_00000", "split": "test", "image_file": "test_00000.jpg",
                      "description": "Not for training."})
        (root / "docci.jsonlines").write_text("".join(json.dumps(d) + "\n" for d in docci))
        self.n_coco, self.n_docci = n_coco, n_docci
        pd.DataFrame(wr).to_parquet(root / "prepared" / "word_regions.parquet")
        pd.DataFrame(sents).to_parquet(root / "prepared" / "sentences.parquet")
        pd.DataFrame(pairs).to_parquet(root / "prepared" / "local_pairs.parquet")
        pd.DataFrame(neg).to_parquet(root / "prepared" / "negatives.parquet")

    def prepared(self, name: str) -> pd.DataFrame:
        return pd.read_parquet(self.root / "prepared" / f"{name}.parquet")


def key_id(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest()[:12], 16)


class StubMethod:
    """A Method (DEVELOPERS.md protocol, data half) that records which sample and which rng draw it saw."""

    def __init__(self, name: str = "stub", source: str | None = None):
        self.name, self.source = name, source

    def wants(self, record: dict) -> bool:
        return self.source is None or record["source"] == self.source

    def make_example(self, record, image, rng, ctx) -> dict:
        return {"sample": torch.tensor(key_id(f"{record['source']}_{record['image_id']}")),
                "draw": torch.tensor(rng.random(), dtype=torch.float64),
                "pixels": ctx.transform(image)}
