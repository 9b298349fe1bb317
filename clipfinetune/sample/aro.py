"""ARO VG-Relation / VG-Attribution cases over dedicated scenes (docs/evalsets.md §4.2).

VG-Relation uses only asymmetric spatial relations (none is on ARO's "symmetric" exclusion list):
"the red circle is above the blue star" vs "the blue star is above the red circle"; the relation
holds robustly (vocab.RELATION_MARGIN), so the swapped caption is false. Relations are balanced.
VG-Attribution pairs two colours: "the red circle and the blue star" vs "the blue circle and the red
star"; the two objects differ in shape and colour and no other object wears either colour, so the
swapped caption is false. Cases are spread evenly over n // 25 colour pairs, so every pair keeps
>= 25 cases (ARO drops pairs below 25). The box (bbox_x/y/w/h, ARO crops to it) is the union of the
two objects' boxes plus a 2 px margin.
"""
from __future__ import annotations

import math

import numpy as np

from .scene import Obj, Scene, holds, new_scene, place, random_background
from .vocab import COLOUR_NAMES, RELATIONS, SHAPE_NAMES

ARO_RELATIONS = ["left", "right", "above", "below"]


def _union_box(a: Obj, b: Obj, size: int) -> dict:
    x0 = max(0, math.floor(min(a.bbox[0], b.bbox[0]) - 2))
    y0 = max(0, math.floor(min(a.bbox[1], b.bbox[1]) - 2))
    x1 = min(size, math.ceil(max(a.bbox[2], b.bbox[2]) + 2))
    y1 = min(size, math.ceil(max(a.bbox[3], b.bbox[3]) + 2))
    return {"bbox_x": x0, "bbox_y": y0, "bbox_w": x1 - x0, "bbox_h": y1 - y0}


def _two_shapes(rng) -> tuple[str, str]:
    i, j = rng.choice(len(SHAPE_NAMES), 2, replace=False)
    return SHAPE_NAMES[int(i)], SHAPE_NAMES[int(j)]


def relation_case(rng: np.random.Generator, image_id: str, size: int, rel: str) -> tuple[Scene, dict]:
    """A scene with two objects (+ maybe a distractor) where 'A <rel> B' holds robustly."""
    for _ in range(200):
        sa, sb = _two_shapes(rng)
        ca, cb = (COLOUR_NAMES[int(i)] for i in rng.choice(len(COLOUR_NAMES), 2, replace=False))
        specs = [(sa, ca, "large" if rng.random() < 0.4 else "small"),
                 (sb, cb, "large" if rng.random() < 0.4 else "small")]
        if rng.random() < 0.5:
            specs.append((SHAPE_NAMES[int(rng.integers(len(SHAPE_NAMES)))],
                          pick_colour(rng, exclude={ca, cb}), "small"))
        objs = place(rng, specs, size)
        if len(objs) < 2 or objs[0].key != (ca, sa) or objs[1].key != (cb, sb):
            continue
        a, b = objs[0], objs[1]
        if not holds(rel, a, b, size):
            continue
        phrase = RELATIONS[rel][0]
        scene = new_scene(image_id, size, random_background(rng), objs)
        rec = {"relation_name": phrase,
               "true_caption": f"the {ca} {sa} is {phrase} the {cb} {sb}",
               "false_caption": f"the {cb} {sb} is {phrase} the {ca} {sa}", **_union_box(a, b, size)}
        return scene, rec
    raise RuntimeError(f"could not place a '{rel}' pair in {image_id}")


def attribution_case(rng: np.random.Generator, image_id: str, size: int,
                     colours: tuple[str, str]) -> tuple[Scene, dict]:
    c0, c1 = colours
    for _ in range(200):
        sa, sb = _two_shapes(rng)
        specs = [(sa, c0, "large" if rng.random() < 0.4 else "small"),
                 (sb, c1, "large" if rng.random() < 0.4 else "small")]
        if rng.random() < 0.5:
            specs.append((SHAPE_NAMES[int(rng.integers(len(SHAPE_NAMES)))],
                          pick_colour(rng, exclude={c0, c1}), "small"))
        if rng.random() < 0.5:
            specs[0], specs[1] = specs[1], specs[0]     # order on the canvas independent of the caption
        objs = place(rng, specs, size)
        keys = [o.key for o in objs]
        if (c0, sa) not in keys or (c1, sb) not in keys:
            continue
        a, b = objs[keys.index((c0, sa))], objs[keys.index((c1, sb))]
        scene = new_scene(image_id, size, random_background(rng), objs)
        rec = {"attributes": [c0, c1],
               "true_caption": f"the {c0} {sa} and the {c1} {sb}",
               "false_caption": f"the {c1} {sa} and the {c0} {sb}", **_union_box(a, b, size)}
        return scene, rec
    raise RuntimeError(f"could not place an attribution pair in {image_id}")


def pick_colour(rng, exclude: set[str]) -> str:
    pool = [c for c in COLOUR_NAMES if c not in exclude]
    return pool[int(rng.integers(len(pool)))]


def attribute_pairs(rng: np.random.Generator, n_cases: int, min_per_pair: int = 25) -> list[tuple[str, str]]:
    """Ordered colour pairs for VG-Attribution: as many as keep >= min_per_pair cases each."""
    all_pairs = [(a, b) for a in COLOUR_NAMES for b in COLOUR_NAMES if a < b]
    k = max(1, min(len(all_pairs), n_cases // min_per_pair))
    chosen = [all_pairs[int(i)] for i in rng.choice(len(all_pairs), k, replace=False)]
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in chosen]
