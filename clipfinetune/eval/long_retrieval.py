"""Long-caption retrieval (DOCCI, DCI, Urban1k, GOAL lists; readers: `clipfinetune.data.evalsets.long_retrieval`):
one caption per image, R@1/5/25/50 both directions as GOAL's `retrieval_goal.py` (docs/evalsets.md §3). Texts go through
the model's own tokenizer, so a Long-CLIP-stretched model sees 248 tokens and a plain one truncates at 77.
"""
from __future__ import annotations

import numpy as np

from clipfinetune.data.evalsets.retrieval import RetrievalSet
from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.retrieval import caption_ids, recall_from_ranks, retrieval_ranks

LONG_KS = (1, 5, 25, 50)


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
