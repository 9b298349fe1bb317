"""Compositionality: SugarCrepe, ARO VG-Relation / VG-Attribution, VALSE, Winoground (docs/evalsets.md §4).
COCO/Flickr-Order live in `aro_order.py`; the readers in `clipfinetune.data.evalsets.compositionality`.

Tie rules follow each official script: SugarCrepe `pos > neg` (strict; ties wrong); ARO VG-R/VG-A
`argmax([false, true]) == 1` (ties -> index 0 -> wrong); VALSE `s(caption) > s(foil)` (strict);
Winoground's text/image scores are strict inequalities.
"""
from __future__ import annotations

import numpy as np
import torch

from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.items import Items, record

# ARO's "symmetric" relations, excluded from the VG-Relation macro accuracy: verbatim from
# mertyg/vision-language-models-are-bows, notebooks/"Replicate ARO! VG-Relation, VG-Attribution.ipynb" (MIT).
ARO_SYMMETRIC_RELATIONS = frozenset([
    'adjusting', 'attached to', 'between', 'bigger than', 'biting', 'boarding', 'brushing', 'chewing',
    'cleaning', 'climbing', 'close to', 'coming from', 'coming out of', 'contain', 'crossing', 'dragging',
    'draped over', 'drinking', 'drinking from', 'driving', 'driving down', 'driving on', 'eating from',
    'eating in', 'enclosing', 'exiting', 'facing', 'filled with', 'floating in', 'floating on', 'flying',
    'flying above', 'flying in', 'flying over', 'flying through', 'full of', 'going down', 'going into',
    'going through', 'grazing in', 'growing in', 'growing on', 'guiding', 'hanging from', 'hanging in',
    'hanging off', 'hanging over', 'higher than', 'holding onto', 'hugging', 'in between', 'jumping off',
    'jumping on', 'jumping over', 'kept in', 'larger than', 'leading', 'leaning over', 'leaving', 'licking',
    'longer than', 'looking in', 'looking into', 'looking out', 'looking over', 'looking through',
    'lying next to', 'lying on top of', 'making', 'mixed with', 'mounted on', 'moving', 'on the back of',
    'on the edge of', 'on the front of', 'on the other side of', 'opening', 'painted on', 'parked at',
    'parked beside', 'parked by', 'parked in', 'parked in front of', 'parked near', 'parked next to',
    'perched on', 'petting', 'piled on', 'playing', 'playing in', 'playing on', 'playing with', 'pouring',
    'reaching for', 'reading', 'reflected on', 'riding on', 'running in', 'running on', 'running through',
    'seen through', 'sitting behind', 'sitting beside', 'sitting by', 'sitting in front of', 'sitting near',
    'sitting next to', 'sitting under', 'skiing down', 'skiing on', 'sleeping in', 'sleeping on',
    'smiling at', 'sniffing', 'splashing', 'sprinkled on', 'stacked on', 'standing against',
    'standing around', 'standing behind', 'standing beside', 'standing in front of', 'standing near',
    'standing next to', 'staring at', 'stuck in', 'surrounding', 'swimming in', 'swinging', 'talking to',
    'topped with', 'touching', 'traveling down', 'traveling on', 'tying', 'typing on', 'underneath',
    'wading in', 'waiting for', 'walking across', 'walking by', 'walking down', 'walking next to',
    'walking through', 'working in', 'working on', 'worn on', 'wrapped around', 'wrapped in', 'by', 'of',
    'near', 'next to', 'with', 'beside', 'on the side of', 'around'])
VGA_MIN_COUNT = 25


def pair_scores(encoder: Encoder, images, texts) -> np.ndarray:
    """[N] cosine s(image_i, text_i) for aligned lists of image keys and texts."""
    img, txt = encoder.images(images), encoder.texts(texts)
    return (img * txt).sum(-1).numpy()


# ---------------------------------------------------------------- SugarCrepe
def evaluate_sugarcrepe(encoder: Encoder, data: dict[str, list[dict]], items: list | None = None) -> dict:
    """Items: one part per file, one item per test case (id = its key in the file)."""
    out = {}
    for task, recs in data.items():
        keys = [(r["image"], None) for r in recs]
        pos = pair_scores(encoder, keys, [r["caption"] for r in recs])
        neg = pair_scores(encoder, keys, [r["negative_caption"] for r in recs])
        correct = pos > neg                                      # strict: ties wrong (main_eval.py)
        record(items, Items(task, "correct", [r.get("id", str(i)) for i, r in enumerate(recs)], correct))
        out[task] = 100.0 * float(correct.mean())
    out["mean"] = float(np.mean([out[t] for t in data]))
    out["n_tasks"] = len(data)
    return out


# ---------------------------------------------------------------- ARO VG-Relation / VG-Attribution
def vg_correct(encoder: Encoder, recs, keys) -> np.ndarray:
    """ARO: options [false, true], argmax == 1 (ties -> 0 -> wrong) == s(true) > s(false)."""
    t = pair_scores(encoder, keys, [r["true_caption"] for r in recs])
    f = pair_scores(encoder, keys, [r["false_caption"] for r in recs])
    return t > f


def macro_groups(groups, exclude=frozenset(), min_count: int = 1) -> list[str]:
    """Each case's group, or "" when its group is excluded or has fewer than `min_count` cases."""
    groups = [str(g) for g in groups]
    counts = {g: groups.count(g) for g in set(groups)}
    return [g if g not in exclude and counts[g] >= min_count else "" for g in groups]


def macro_accuracy(correct, groups, exclude=frozenset(), min_count: int = 1):
    """Mean over groups (not excluded, >= min_count cases) of per-group accuracy, in percent; None if none."""
    correct, kept = np.asarray(correct, dtype=np.float64), np.asarray(macro_groups(groups, exclude, min_count))
    accs = [correct[kept == g].mean() for g in sorted(set(kept.tolist()) - {""})]
    return (100.0 * float(np.mean(accs)) if accs else None), len(accs)


def evaluate_vg(encoder: Encoder, cases: dict[str, tuple], vga_min_count: int = VGA_MIN_COUNT,
                items: list | None = None) -> dict:
    """`cases`: `read_vg`'s. VG-R: per-relation accuracy, mean over non-symmetric relations. VG-A: per attribute pair
    `a0_a1` accuracy, mean over pairs with >= 25 cases. Either file may be absent (-> not reported).
    Items: parts vg_relation / vg_attribution (id = index in the file), labelled with the macro group
    ("" for a case outside the macro average: symmetric relation, rare attribute pair)."""
    out = {}
    if "vg_relation" in cases:
        recs, keys = cases["vg_relation"]
        ok = vg_correct(encoder, recs, keys)
        groups = [r["relation_name"] for r in recs]
        record(items, Items("vg_relation", "correct", [f"{i:06d}" for i in range(len(recs))], ok,
                            macro_groups(groups, ARO_SYMMETRIC_RELATIONS)))
        out["vg_relation"], out["n_vg_relation_groups"] = macro_accuracy(ok, groups, exclude=ARO_SYMMETRIC_RELATIONS)
        out["vg_relation_micro"] = 100.0 * float(ok.mean())
    if "vg_attribution" in cases:
        recs, keys = cases["vg_attribution"]
        ok = vg_correct(encoder, recs, keys)
        groups = [f"{r['attributes'][0]}_{r['attributes'][1]}" for r in recs]
        record(items, Items("vg_attribution", "correct", [f"{i:06d}" for i in range(len(recs))], ok,
                            macro_groups(groups, min_count=vga_min_count)))
        out["vg_attribution"], out["n_vg_attribution_groups"] = macro_accuracy(ok, groups, min_count=vga_min_count)
        out["vg_attribution_micro"] = 100.0 * float(ok.mean())
    return out


# ---------------------------------------------------------------- VALSE
def evaluate_valse(encoder: Encoder, data: dict[str, list[dict]], items: list | None = None) -> dict:
    """Items: one part per piece, one item per valid sample (id = its key in the piece file)."""
    out = {}
    for piece, recs in data.items():
        if not recs:
            out[piece] = None
            continue
        keys = [(r["image"], None) for r in recs]
        c = pair_scores(encoder, keys, [r["caption"] for r in recs])
        f = pair_scores(encoder, keys, [r["foil"] for r in recs])
        correct = c > f                                          # acc_r, strict
        record(items, Items(piece, "correct", [r.get("id", str(i)) for i, r in enumerate(recs)], correct))
        out[piece] = 100.0 * float(correct.mean())
    vals = [v for v in out.values() if v is not None]
    out["mean"] = float(np.mean(vals)) if vals else None
    out["n_valid"] = sum(len(r) for r in data.values())
    return out


# ---------------------------------------------------------------- Winoground
def winoground_correct(s: np.ndarray) -> dict[str, np.ndarray]:
    """s [N, 2 captions, 2 images] -> per-example text / image / group success (Thrush et al. 2022)."""
    text = (s[:, 0, 0] > s[:, 1, 0]) & (s[:, 1, 1] > s[:, 0, 1])
    image = (s[:, 0, 0] > s[:, 0, 1]) & (s[:, 1, 1] > s[:, 1, 0])
    return {"text": text, "image": image, "group": text & image}


def evaluate_winoground(encoder: Encoder, data: list[dict], items: list | None = None) -> dict:
    """Items: parts text / image / group, one item per example (id = its Winoground id)."""
    img = encoder.images([(p, None) for r in data for p in r["images"]]).reshape(len(data), 2, -1)
    txt = encoder.texts([c for r in data for c in r["captions"]]).reshape(len(data), 2, -1)
    s = torch.einsum("ncd,nid->nci", txt, img).numpy()
    correct = winoground_correct(s)
    ids = [r.get("id", str(i)) for i, r in enumerate(data)]
    record(items, *(Items(part, "correct", ids, c) for part, c in correct.items()))
    return {**{k: 100.0 * float(c.mean()) for k, c in correct.items()}, "n": len(data)}
