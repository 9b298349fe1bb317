"""Box (region) classification from RoIAlign'd dense features (CLIPSelf / FineCLIP, docs/evalsets.md §5).

Readers (COCO instances, COCO panoptic, LVIS; which boxes count): `clipfinetune.data.evalsets.box_cls`. Features:
`model.region_features` on the squash-resized image, boxes mapped from original to input pixels by
`clipfinetune.boxes.resize_boxes` (FineCLIP's transform). Classifier: the 63 ViLD templates ("This is " prefixed to
texts starting with "a"/"the"), mean of normalised embeddings per class, renormalised; logits = region @ classifierᵀ.
The text tower is the evaluated model's own (`own`) or another model's (`base`, FineCLIP's protocol).
Metrics: top1/top5 over all boxes and macc1/macc5 = mean over present classes of per-class accuracy
(CLIPSelf `_macc`); top5/macc5 are null with fewer than 5 classes. LVIS adds macc1_{r,c,f}.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from clipfinetune.data.evalsets.box_cls import BoxSet
from clipfinetune.eval.encode import Encoder, fill_template
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.ranking import mean_per_class, topk_hits


@lru_cache(maxsize=1)
def vild_templates() -> list[str]:
    return json.loads((Path(__file__).parent / "templates" / "vild.json").read_text())["templates"]


def class_prompts(name: str) -> list[str]:
    """The 63 ViLD texts for one class name, with CLIPSelf/FineCLIP's "This is " prefix."""
    texts = [fill_template(t, name) for t in vild_templates()]
    return ["This is " + t if t.startswith(("a", "the")) else t for t in texts]


def box_metrics(logits, labels, frequency=None, hits: dict | None = None) -> dict:
    """`hits`, when given, receives the per-box hit arrays {"top1": [N] bool, "top5": ...}."""
    labels = np.asarray(labels)
    n_cls = logits.shape[1]
    top1 = topk_hits(logits, labels, 1)
    hits = {} if hits is None else hits
    hits["top1"] = top1
    out = {"top1": 100.0 * float(top1.mean()), "macc1": mean_per_class(top1, labels)}
    if n_cls >= 5:
        top5 = hits["top5"] = topk_hits(logits, labels, 5)
        out.update(top5=100.0 * float(top5.mean()), macc5=mean_per_class(top5, labels))
    else:
        out.update(top5=None, macc5=None)
    if frequency is not None:
        freq = np.asarray(frequency)[labels]
        for f in ("r", "c", "f"):
            m = freq == f
            out[f"macc1_{f}"] = mean_per_class(top1[m], labels[m]) if m.any() else None
    return out


def box_ids(data: BoxSet) -> list[str]:
    """`<image>#<k>`: the k-th kept box of its image, in annotation order (stable across models)."""
    return [f"{p}#{k}" for p, b in data.images for k in range(len(b))]


def evaluate_box_cls(encoder: Encoder, data: BoxSet, text_encoder: Encoder | None = None,
                     items: list | None = None) -> dict:
    """Region features from `encoder`'s model; class texts through `text_encoder` (default: the same).
    Items: parts top1 / top5 (hit per box), labelled `<class index>:<class name>`."""
    if not data.labels:
        raise ValueError("box classification set has no boxes left after filtering")
    text_encoder = text_encoder or encoder
    feats = encoder.regions([(p, torch.from_numpy(b)) for p, b in data.images])
    prompts = [class_prompts(c) for c in data.classnames]
    w = _classifier(text_encoder, prompts)
    logits = (feats @ w.T).numpy()
    hits: dict = {}
    out = box_metrics(logits, data.labels, data.frequency, hits)
    ids, names = box_ids(data), [f"{c}:{data.classnames[c]}" for c in data.labels]
    record(items, *(Items(part, "correct", ids, h, names) for part, h in hits.items()))
    out.update(n_boxes=len(data.labels), n_classes=len(data.classnames),
               **{f"n_skipped_{k}": v for k, v in data.skipped.items()})
    return out


def _classifier(text_encoder: Encoder, prompts: list[list[str]]) -> torch.Tensor:
    rows = [torch.nn.functional.normalize(text_encoder.texts(p).mean(0), dim=-1) for p in prompts]
    return torch.stack(rows)
