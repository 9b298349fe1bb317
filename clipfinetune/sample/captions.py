"""Short COCO-style captions and DOCCI-style long descriptions of a scene.

Short captions mention only some objects (one to three noun phrases), vary their wording (prefixes
such as "a photo of" / "there is", plurals "two red circles", optional sizes, spatial relations) and
are true of the scene by construction: every noun phrase is built from a group of objects that the
scene holds, a relation is used only when it holds robustly (vocab.RELATION_MARGIN).

Long descriptions: sentence 0 summarises ("An image of five shapes on a dark grey background."),
each following sentence describes exactly one object (size, colour, shape, 3 x 3 position), and a
few background sentences may close the text. They contain no other full stops, so any sentence
splitter (spaCy, GOAL's split('.')) recovers the same sentences.
"""
from __future__ import annotations

import numpy as np

from .scene import Obj, Scene, groups, position_name, true_relations
from .vocab import NUMBER_WORDS, RELATIONS, SIZE_WORDS, article, plural


def pick(rng: np.random.Generator, seq):
    return seq[int(rng.integers(len(seq)))]


def noun_phrase(shape: str, count: int = 1, colour: str | None = None, size: str | None = None,
                definite: bool = False, rng: np.random.Generator | None = None) -> str:
    """"a small red circle", "two blue stars", "the cyan ring"."""
    words = []
    if size:
        words.append(pick(rng, SIZE_WORDS[size]) if rng is not None else size)
    if colour:
        words.append(colour)
    words.append(shape if count == 1 else plural(shape))
    head = " ".join(words)
    if count == 1:
        return ("the " if definite else article(head) + " ") + head
    return f"{NUMBER_WORDS[count]} {head}"


def relation_phrase(rel: str, rng: np.random.Generator) -> str:
    return pick(rng, RELATIONS[rel])


def capitalise(text: str) -> str:
    return text[0].upper() + text[1:]


# ---------------------------------------------------------------- short captions

def _group_np(rng, objs: list[Obj], p_colour=0.85, p_size=0.35) -> tuple[str, int]:
    """Noun phrase for a group of same (colour, shape) objects; returns (text, count)."""
    sizes = {o.size for o in objs}
    size = objs[0].size if len(sizes) == 1 and rng.random() < p_size else None
    colour = objs[0].colour if rng.random() < p_colour else None
    if colour is None:       # shape only: count every object of that shape
        return noun_phrase(objs[0].shape, len(objs), None, size, rng=rng), len(objs)
    return noun_phrase(objs[0].shape, len(objs), colour, size, rng=rng), len(objs)


def _shape_groups(scene: Scene) -> dict:
    """Groups by (colour, shape); a colourless mention must count all objects of that shape."""
    g = groups(scene.objects)
    by_shape: dict[str, int] = {}
    for o in scene.objects:
        by_shape[o.shape] = by_shape.get(o.shape, 0) + 1
    return {k: v for k, v in g.items() if by_shape[k[1]] == len(v)}, g


def _mentions(rng, scene: Scene, n: int) -> list[tuple[str, int]]:
    clean, g = _shape_groups(scene)
    keys = list(g)
    chosen = [keys[i] for i in rng.permutation(len(keys))[:n]]
    out = []
    for k in chosen:
        # a colourless phrase only when every object of that shape is in the group
        out.append(_group_np(rng, g[k], p_colour=0.85 if k in clean else 1.0))
    return out


def _there(np_text: str, count: int) -> str:
    return ("there are " if count > 1 else "there is ") + np_text


KINDS = ["one", "two", "relation", "one", "two", "relation", "three", "background", "count"]


def short_caption(rng: np.random.Generator, scene: Scene, kind: str | None = None) -> str:
    n_groups = len(groups(scene.objects))
    kind = kind or pick(rng, KINDS)
    if kind == "relation":
        text = _relation_caption(rng, scene)
        if text:
            return capitalise(text) + "."
        kind = "two"
    if kind == "three" and n_groups < 3:
        kind = "two"
    if kind == "two" and n_groups < 2 or kind == "count" and len(scene.objects) < 2:   # no "one shapes"
        kind = "one"
    if kind == "one":
        (np_text, c), = _mentions(rng, scene, 1)
        prefix = pick(rng, ["a photo of ", "an image of ", "a picture of ", "", "there", "a close-up of "])
        text = _there(np_text, c) if prefix == "there" else prefix + np_text
    elif kind == "two":
        (a, _), (b, _) = _mentions(rng, scene, 2)
        prefix = pick(rng, ["", "", "a photo of ", "an image with ", "there"])
        text = _there(f"{a} and {b}", 2) if prefix == "there" else f"{prefix}{a} and {b}"
    elif kind == "three":
        (a, _), (b, _), (c, _) = _mentions(rng, scene, 3)
        text = pick(rng, ["", "a picture of ", "shapes: "]) + f"{a}, {b} and {c}"
    elif kind == "background":
        (np_text, _), = _mentions(rng, scene, 1)
        text = f"{np_text} on a dark background"
    else:   # count
        (np_text, _), = _mentions(rng, scene, 1)
        text = f"{NUMBER_WORDS[len(scene.objects)]} shapes including {np_text}"
    return capitalise(text) + "."


def _relation_caption(rng, scene: Scene) -> str | None:
    """'A red circle to the left of a blue star' over two singleton groups with a robust relation."""
    g = groups(scene.objects)
    singles = [v[0] for v in g.values() if len(v) == 1]
    pairs = [(a, b, r) for a in singles for b in singles if a is not b for r in true_relations(a, b, scene.size)]
    if not pairs:
        return None
    a, b, r = pairs[int(rng.integers(len(pairs)))]
    na = noun_phrase(a.shape, 1, a.colour, a.size if rng.random() < 0.3 else None, rng=rng)
    nb = noun_phrase(b.shape, 1, b.colour, b.size if rng.random() < 0.3 else None, rng=rng)
    verb = pick(rng, ["", "", " is"])
    return f"{na}{verb} {relation_phrase(r, rng)} {nb}"


def short_captions(rng: np.random.Generator, scene: Scene, n: int = 5) -> list[str]:
    """n distinct short captions (distinct wording; a tiny scene may repeat after 60 tries)."""
    caps: list[str] = []
    kinds = [KINDS[i] for i in rng.permutation(len(KINDS))]      # varied kinds first, then any
    for t in range(60):
        c = short_caption(rng, scene, kinds[t] if t < len(kinds) else None)
        if c not in caps:
            caps.append(c)
        if len(caps) == n:
            return caps
    while len(caps) < n:
        caps.append(short_caption(rng, scene))
    return caps


# ---------------------------------------------------------------- pretraining captions

PRETRAIN_NAMING = {"shapes": 0.3, "every": 0.4, "short": 0.3}   # share of each kind of pretraining caption


def listing_caption(rng: np.random.Generator, scene: Scene, colours: bool) -> str:
    """Every object of the scene, by (colour, shape) group ("A red star and two blue rings.") or, without
    colours, by shape ("A star and two rings."): true and complete, so only the named attributes match it."""
    counts: dict = {}
    for o in scene.objects:
        key = (o.colour, o.shape) if colours else (None, o.shape)
        counts[key] = counts.get(key, 0) + 1
    keys = list(counts)
    nps = [noun_phrase(shape, counts[(colour, shape)], colour) for colour, shape in
           (keys[i] for i in rng.permutation(len(keys)))]
    body = nps[0] if len(nps) == 1 else ", ".join(nps[:-1]) + " and " + nps[-1]
    return capitalise(pick(rng, ["", "a photo of ", "an image of "]) + body) + "."


def pretraining_captions(rng: np.random.Generator, scene: Scene, n: int = 5) -> list[str]:
    """n captions that vary in what they name (PRETRAIN_NAMING): shapes only, every object with its colour, or
    an ordinary short caption. A shapes-only caption fits images of any colours, so colour alone cannot match it;
    the base CLIP trained on the plain short captions settles on colour and never separates shape words (issue 22).
    Repeats are allowed (a one-object image has few distinct true captions)."""
    kinds, weights = list(PRETRAIN_NAMING), np.array(list(PRETRAIN_NAMING.values()))
    out = []
    for _ in range(n):
        kind = kinds[int(rng.choice(len(kinds), p=weights / weights.sum()))]
        out.append(short_caption(rng, scene) if kind == "short" else listing_caption(rng, scene, kind == "every"))
    return out


# ---------------------------------------------------------------- long (DOCCI-style) descriptions

def _where(pos: str) -> str:
    if pos.endswith("corner") or pos == "centre":
        return "in the " + pos
    if pos.endswith("side"):
        return "on the " + pos
    return "at the " + pos


BACKGROUND_SENTENCES = ["The background is a plain {bg} colour.", "The background has a faint grainy texture.",
                        "None of the shapes overlap one another.", "The shapes are spread over the whole image.",
                        "There is no text anywhere in the image.", "The lighting is flat and even."]


def object_sentence(rng: np.random.Generator, o: Obj, size: int) -> str:
    np_text = noun_phrase(o.shape, 1, o.colour, o.size, rng=rng)
    where = _where(position_name(o, size))
    form = int(rng.integers(4))
    if form == 0:
        text = f"{capitalise(np_text)} is {where}"
    elif form == 1:
        text = f"{capitalise(where)} there is {np_text}"
    elif form == 2:
        text = f"{capitalise(np_text)} sits {where}"
    else:
        text = f"There is {np_text} {where}"
    if abs(o.angle) > 8 and rng.random() < 0.5:
        text += ", slightly tilted"
    return text + "."


def long_description(rng: np.random.Generator, scene: Scene, extra: int) -> tuple[str, list[int]]:
    """(description, object index per sentence 1..n). Objects in reading order; `extra` closing
    background sentences follow (no object)."""
    n = len(scene.objects)
    bg = scene.background
    summary = pick(rng, [f"An image of {NUMBER_WORDS[n]} shapes on a {bg} background.",
                         f"A picture of {NUMBER_WORDS[n]} coloured shapes on a {bg} background.",
                         f"{capitalise(NUMBER_WORDS[n])} simple shapes are shown on a {bg} background."])
    order = sorted(range(n), key=lambda i: (int(3 * scene.objects[i].cy / scene.size),
                                            scene.objects[i].cx))
    sentences = [summary] + [object_sentence(rng, scene.objects[i], scene.size) for i in order]
    closing = [BACKGROUND_SENTENCES[i].format(bg=bg) for i in rng.permutation(len(BACKGROUND_SENTENCES))[:extra]]
    return " ".join(sentences + closing), order
