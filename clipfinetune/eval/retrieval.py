"""Image-text retrieval (COCO Karpathy 5K, Flickr30k 1K): I->T / T->I R@K (docs/evalsets.md §1.6, §1.7, §2) on a
`RetrievalSet` (its readers: `clipfinetune.data.evalsets.retrieval`).

I->T: an image query is a hit when ANY of its ground-truth captions is in the top K (min-rank over
GT captions, BLIP `itm_eval`); T->I: a caption query is a hit when its image is in the top K.
Ties: see `ranking.py` (a tied negative ranks ahead).
"""
from __future__ import annotations

import numpy as np

from clipfinetune.data.evalsets.retrieval import RetrievalSet
from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.items import Items, record
from clipfinetune.eval.ranking import negatives_ahead


def retrieval_ranks(image_emb, text_emb, caption_image) -> tuple[np.ndarray, np.ndarray]:
    """1-based rank of the first correct item per image query (I->T) and per caption query (T->I)."""
    caption_image = np.asarray(caption_image)
    sims = (image_emb @ text_emb.T).numpy()                       # [N, M]
    pos = caption_image[None, :] == np.arange(sims.shape[0])[:, None]
    return negatives_ahead(sims, pos) + 1, negatives_ahead(sims.T, pos.T) + 1


def recall_from_ranks(i2t, t2i, ks) -> dict[str, float]:
    return {**{f"i2t_r{k}": 100.0 * float((i2t <= k).mean()) for k in ks},
            **{f"t2i_r{k}": 100.0 * float((t2i <= k).mean()) for k in ks}}


def caption_ids(data: RetrievalSet) -> list[str]:
    """`<image>#<k>`: the k-th caption of its image (stable across models)."""
    seen: dict[int, int] = {}
    out = []
    for i in data.caption_image:
        out.append(f"{data.images[i]}#{seen.get(i, 0)}")
        seen[i] = seen.get(i, 0) + 1
    return out


def evaluate_retrieval(encoder: Encoder, data: RetrievalSet, ks=(1, 5, 10), items: list | None = None) -> dict:
    img = encoder.images([(p, None) for p in data.images])
    txt = encoder.texts(data.captions)
    i2t, t2i = retrieval_ranks(img, txt, data.caption_image)
    record(items, Items("i2t", "rank", list(data.images), i2t), Items("t2i", "rank", caption_ids(data), t2i))
    out = recall_from_ranks(i2t, t2i, ks)
    out.update(n_images=len(data.images), n_captions=len(data.captions))
    return out
