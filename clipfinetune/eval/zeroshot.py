"""Zero-shot classification, open_clip / CLIP_benchmark style (docs/evalsets.md §6).

Layout and templates: `clipfinetune.data.evalsets.zeroshot` (ImageFolder, classnames.txt, templates).
Classifier: per class, mean of the normalised template embeddings, renormalised (open_clip
`build_zero_shot_classifier`). Metrics: acc1, acc5 (null with < 5 classes, as CLIP_benchmark's NaN),
mean_per_class = mean per-class recall over classes present (sklearn `balanced_accuracy_score`).
"""
from __future__ import annotations

import numpy as np

from clipfinetune.data.evalsets.zeroshot import ZeroShotSet
from clipfinetune.eval.encode import Encoder, text_classifier
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.ranking import mean_per_class, topk_hits


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
