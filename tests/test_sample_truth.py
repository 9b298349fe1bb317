"""An independent reader of the sample world's captions, and the tiny world shared by the sample tests.

`caption_is_true(text, objects)` parses noun phrases ("two small red circles", "the cyan ring") and
spatial relations between consecutive phrases ("... to the left of ...") with its own word tables, and
checks them against a scene record (objects with shape, colour, size, centre). Relations are read
loosely (any difference of centres in the right direction), so a negative counts as false only if it
is false even under that generous reading. The tests of this file check the reader itself.
"""
from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import tempfile
from pathlib import Path

# our own reading of the words (not imported from the generator)
NUMBERS = {"a": 1, "an": 1, "the": 1, "one": 1, "two": 2, "three": 3, "four": 4}
SIZE = {"small": "small", "little": "small", "large": "large", "big": "large"}
RELATION = {"to the left of": "left", "left of": "left", "to the right of": "right", "right of": "right",
            "above": "above", "over": "above", "below": "below", "under": "below"}
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "cyan"]
SHAPES = ["circle", "ring", "heart", "square", "triangle", "diamond", "star", "cross"]
COUNT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
               "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen"]

_NP = re.compile(r"\b(?P<det>a|an|the|one|two|three|four)\s+(?:(?P<size>small|little|large|big)\s+)?"
                 rf"(?:(?P<colour>{'|'.join(COLOURS)})\s+)?(?P<shape>{'|'.join(SHAPES)})(?P<pl>s)?\b")


def parse(text: str) -> tuple[list[dict], list[tuple[int, str, int]], int | None]:
    """-> (noun phrases, relations (i, rel, j) between consecutive phrases, claimed total or None)."""
    t = text.lower().rstrip(".")
    nps = [{"count": NUMBERS[m["det"]], "size": SIZE.get(m["size"]), "colour": m["colour"],
            "shape": m["shape"], "plural": bool(m["pl"]), "span": m.span()} for m in _NP.finditer(t)]
    rels = []
    for i in range(len(nps) - 1):
        between = t[nps[i]["span"][1]:nps[i + 1]["span"][0]].strip()
        between = re.sub(r"^is\s+", "", between)
        if between in RELATION:
            rels.append((i, RELATION[between], i + 1))
    m = re.search(rf"\b({'|'.join(COUNT_WORDS)})(?: [a-z]+)? shapes\b", t)
    return nps, rels, (COUNT_WORDS.index(m[1]) if m else None)


def _matches(np_: dict, o: dict) -> bool:
    return o["shape"] == np_["shape"] and (np_["colour"] in (None, o["colour"])) and \
        (np_["size"] in (None, o["size"]))


def _rel(rel: str, a: dict, b: dict) -> bool:
    return {"left": a["cx"] < b["cx"], "right": a["cx"] > b["cx"],
            "above": a["cy"] < b["cy"], "below": a["cy"] > b["cy"]}[rel]


def caption_is_true(text: str, objects: list[dict]) -> bool:
    nps, rels, total = parse(text)
    if total is not None and total != len(objects):
        return False
    for np_ in nps:
        if np_["plural"] != (np_["count"] > 1):
            return False
        if sum(_matches(np_, o) for o in objects) < np_["count"]:
            return False
    for i, rel, j in rels:
        if not any(_rel(rel, a, b) for a in objects if _matches(nps[i], a)
                   for b in objects if b is not a and _matches(nps[j], b)):
            return False
    return True


def shape_words(text: str) -> int:
    return len(re.findall(rf"\b({'|'.join(SHAPES)})s?\b", text.lower()))


HUES = [(15, "red"), (40, "orange"), (70, "yellow"), (160, "green"), (200, "cyan"), (250, "blue"),
        (320, "purple"), (361, "red")]


def colour_name(rgb) -> str:
    """A human reading of an RGB colour: white if unsaturated and bright, else by hue range."""
    import colorsys

    h, s, v = colorsys.rgb_to_hsv(*(float(c) / 255 for c in rgb))
    if s < 0.25 and v > 0.7:
        return "white"
    return next(name for upper, name in HUES if h * 360 < upper)


# ---------------------------------------------------------------- the small world the sample tests share
# (a generator config: enough scenes for the world's statistics; the pipeline tests' params profile is
# tests/fixtures/project.py TINY)

SMALL_WORLD = {"seed": 0, "image_size": 64, "n_train": 40, "n_val": 30, "n_docci_train": 40, "n_docci_test": 30,
               "n_compositional": 50, "n_zeroshot_per_class": 2, "n_pretrain": 40}


@functools.cache
def world(**overrides) -> Path:
    from clipfinetune.sample.world import WorldConfig, generate_world

    root = Path(tempfile.mkdtemp(prefix="cft-sample-"))
    atexit.register(shutil.rmtree, root, True)
    generate_world(root / "sample", WorldConfig(**{**SMALL_WORLD, **overrides}))
    return root / "sample"


def tiny_world() -> Path:
    return world()


def scenes(root: Path) -> dict[str, dict]:
    recs = [json.loads(line) for line in (root / "scenes.jsonl").read_text().splitlines()]
    return {r["image"]: r for r in recs}


# ---------------------------------------------------------------- the reader's own tests

def _obj(shape, colour, size, cx, cy):
    return {"shape": shape, "colour": colour, "size": size, "cx": cx, "cy": cy}


SCENE = [_obj("circle", "red", "small", 10, 10), _obj("square", "blue", "large", 40, 40),
         _obj("circle", "red", "large", 50, 10)]


def test_reader_accepts_true_captions():
    for text in ["A red circle.", "Two red circles.", "There is a big blue square.",
                 "A red circle to the left of a blue square.", "A blue square is below a small red circle.",
                 "Three shapes including a blue square.", "A photo of two circles and a square."]:
        assert caption_is_true(text, SCENE), text


def test_reader_rejects_false_captions():
    for text in ["A blue circle.", "Three red circles.", "A small blue square.", "A red star.",
                 "A blue square to the left of a small red circle.", "Two shapes including a red circle.",
                 "A red circle and a blue circle.", "Two red circle."]:
        assert not caption_is_true(text, SCENE), text


def test_reader_finds_every_shape_word():
    nps, rels, _ = parse("An image of a small orange triangle over two cyan rings and a star.")
    assert [n["shape"] for n in nps] == ["triangle", "ring", "star"] and rels == [(0, "above", 1)]
