"""SugarCrepe-style hard negatives over the val scenes (seven files, docs/evalsets.md §4.1).

A case is built from structured mentions of the scene (never by editing strings), and its negative
changes exactly one thing so that it becomes false for the image:
- replace_obj: a mentioned shape -> a shape absent from the image;
- replace_att: a colour -> a colour no object of that shape has (preferably absent from the image),
  or a size -> the other size when no object of that colour and shape has it;
- replace_rel: a robust relation -> a robustly false one (the opposite of a true relation);
- swap_obj:    "A <rel> B" -> "B <rel> A" (asymmetric relation, robust);
- swap_att:    colours swapped between two objects of different shapes and colours, when neither
  swapped (colour, shape) exists in the image;
- add_obj:     "... and <a shape absent from the image>";
- add_att:     a colourless mention of the only object of its shape gets a colour (or size) it lacks.
Objects in a relation are the only ones of their colour and shape, so the phrase names one object.
"""
from __future__ import annotations

import numpy as np

from .captions import capitalise, noun_phrase, pick, relation_phrase
from .scene import Obj, Scene, false_relations, groups, true_relations
from .vocab import COLOUR_NAMES, SHAPE_NAMES

KINDS = ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att"]
PREFIXES = ["", "", "a photo of ", "an image of ", "a picture of "]


def _np(shape, count=1, colour=None, size=None) -> str:
    return noun_phrase(shape, count, colour, size)          # canonical words: only the edit differs


def _join(nps: list[str]) -> str:
    return nps[0] if len(nps) == 1 else ", ".join(nps[:-1]) + " and " + nps[-1]


def _finish(prefix: str, text: str) -> str:
    return capitalise(prefix + text) + "."


def _singles(scene: Scene) -> list[Obj]:
    return [v[0] for v in groups(scene.objects).values() if len(v) == 1]


def _present(scene: Scene) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    return ({o.shape for o in scene.objects}, {o.colour for o in scene.objects},
            {(o.colour, o.shape) for o in scene.objects})


def _relation_pairs(scene: Scene) -> list[tuple[Obj, Obj, str]]:
    s = _singles(scene)
    return [(a, b, r) for a in s for b in s if a is not b for r in true_relations(a, b, scene.size)]


def _group_mentions(rng, scene: Scene, k: int) -> list[tuple[str, int, str, str | None]]:
    g = groups(scene.objects)
    keys = [list(g)[i] for i in rng.permutation(len(g))[:k]]
    out = []
    for colour, shape in keys:
        objs = g[(colour, shape)]
        same_size = len({o.size for o in objs}) == 1
        out.append((shape, len(objs), colour, objs[0].size if same_size and rng.random() < 0.3 else None))
    return out


def replace_obj(rng, scene: Scene):
    shapes, _, _ = _present(scene)
    absent = [s for s in SHAPE_NAMES if s not in shapes]
    if not absent:
        return None
    ms = _group_mentions(rng, scene, int(rng.integers(1, 3)))
    i, new = int(rng.integers(len(ms))), pick(rng, absent)
    neg = list(ms)
    neg[i] = (new,) + ms[i][1:]
    prefix = pick(rng, PREFIXES)
    return _finish(prefix, _join([_np(*m) for m in ms])), _finish(prefix, _join([_np(*m) for m in neg]))


def replace_att(rng, scene: Scene):
    _, colours, pairs = _present(scene)
    ms = _group_mentions(rng, scene, int(rng.integers(1, 3)))
    i = int(rng.integers(len(ms)))
    shape, count, colour, size = ms[i]
    g = groups(scene.objects)[(colour, shape)]
    if size is not None and rng.random() < 0.5:
        other = "large" if size == "small" else "small"
        if any(o.size == other for o in g):
            return None
        new = (shape, count, colour, other)
    else:
        cands = [c for c in COLOUR_NAMES if c not in colours] or \
                [c for c in COLOUR_NAMES if (c, shape) not in pairs]
        new = (shape, count, pick(rng, cands), size)
    neg = list(ms)
    neg[i] = new
    prefix = pick(rng, PREFIXES)
    return _finish(prefix, _join([_np(*m) for m in ms])), _finish(prefix, _join([_np(*m) for m in neg]))


def _rel_text(a: Obj, phrase: str, b: Obj) -> str:
    return f"{_np(a.shape, 1, a.colour)} {phrase} {_np(b.shape, 1, b.colour)}"


def replace_rel(rng, scene: Scene):
    pairs = _relation_pairs(scene)
    if not pairs:
        return None
    a, b, r = pairs[int(rng.integers(len(pairs)))]
    r_neg = pick(rng, false_relations(a, b, scene.size))
    prefix = pick(rng, PREFIXES)
    return (_finish(prefix, _rel_text(a, relation_phrase(r, rng), b)),
            _finish(prefix, _rel_text(a, relation_phrase(r_neg, rng), b)))


def swap_obj(rng, scene: Scene):
    pairs = _relation_pairs(scene)
    if not pairs:
        return None
    a, b, r = pairs[int(rng.integers(len(pairs)))]
    phrase, prefix = relation_phrase(r, rng), pick(rng, PREFIXES)
    return _finish(prefix, _rel_text(a, phrase, b)), _finish(prefix, _rel_text(b, phrase, a))


def swap_att(rng, scene: Scene):
    _, _, present = _present(scene)
    s = _singles(scene)
    cands = [(a, b) for a in s for b in s if a is not b and a.shape != b.shape and a.colour != b.colour
             and (b.colour, a.shape) not in present and (a.colour, b.shape) not in present]
    if not cands:
        return None
    a, b = cands[int(rng.integers(len(cands)))]
    prefix = pick(rng, PREFIXES)
    rels = true_relations(a, b, scene.size)
    if rels and rng.random() < 0.5:
        phrase = relation_phrase(pick(rng, rels), rng)
        pos = f"{_np(a.shape, 1, a.colour)} {phrase} {_np(b.shape, 1, b.colour)}"
        neg = f"{_np(a.shape, 1, b.colour)} {phrase} {_np(b.shape, 1, a.colour)}"
    else:
        pos = f"{_np(a.shape, 1, a.colour)} and {_np(b.shape, 1, b.colour)}"
        neg = f"{_np(a.shape, 1, b.colour)} and {_np(b.shape, 1, a.colour)}"
    return _finish(prefix, pos), _finish(prefix, neg)


def add_obj(rng, scene: Scene):
    shapes, _, _ = _present(scene)
    absent = [s for s in SHAPE_NAMES if s not in shapes]
    if not absent:
        return None
    ms = [_np(*m) for m in _group_mentions(rng, scene, int(rng.integers(1, 3)))]
    new = _np(pick(rng, absent), 1, pick(rng, COLOUR_NAMES) if rng.random() < 0.6 else None)
    prefix = pick(rng, PREFIXES)
    return _finish(prefix, _join(ms)), _finish(prefix, _join(ms + [new]))


def add_att(rng, scene: Scene):
    by_shape: dict[str, list[Obj]] = {}
    for o in scene.objects:
        by_shape.setdefault(o.shape, []).append(o)
    lonely = [v[0] for v in by_shape.values() if len(v) == 1]
    if not lonely:
        return None
    t = lonely[int(rng.integers(len(lonely)))]
    if rng.random() < 0.25:
        new = _np(t.shape, 1, None, "large" if t.size == "small" else "small")
    else:
        colours = [o.colour for o in scene.objects if o.colour != t.colour]
        pool = colours if colours and rng.random() < 0.5 else [c for c in COLOUR_NAMES if c != t.colour]
        new = _np(t.shape, 1, pick(rng, pool))
    others = [o for o in scene.objects if o.shape != t.shape]
    prefix = pick(rng, PREFIXES)
    pos, neg = [_np(t.shape)], [new]
    if others and rng.random() < 0.6:
        o = others[int(rng.integers(len(others)))]
        other = _np(o.shape, 1, o.colour)
        pos, neg = ([other] + pos, [other] + neg) if rng.random() < 0.5 else (pos + [other], neg + [other])
    return _finish(prefix, _join(pos)), _finish(prefix, _join(neg))


MAKERS = {"replace_obj": replace_obj, "replace_att": replace_att, "replace_rel": replace_rel,
          "swap_obj": swap_obj, "swap_att": swap_att, "add_obj": add_obj, "add_att": add_att}


def sugarcrepe(rng: np.random.Generator, scenes: list[Scene], file_names: list[str], kind: str,
               n: int) -> dict[str, dict]:
    """n cases of one kind, keyed "0".."n-1", cycling over the scenes in a seeded order."""
    make, cases, seen = MAKERS[kind], {}, set()
    order = rng.permutation(len(scenes))
    for step in range(40 * max(n, 1)):
        if len(cases) == n:
            break
        i = int(order[step % len(order)])
        made = make(rng, scenes[i])
        if made is None or made[0] == made[1] or (i,) + made in seen:
            continue
        seen.add((i,) + made)
        cases[str(len(cases))] = {"filename": file_names[i], "caption": made[0], "negative_caption": made[1]}
    return cases
