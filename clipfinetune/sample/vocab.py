"""The sample world's vocabulary: shapes (= COCO categories), colours, sizes, relations, wording.

Everything the generator draws or says comes from these tables, so a caption can only name what a
scene record holds. Shape names are the COCO category names and are used verbatim in captions (the
word-region stage matches caption words to category names); plurals add an "s".
"""
from __future__ import annotations

# shape name -> COCO supercategory
SHAPES: dict[str, str] = {
    "circle": "round", "ring": "round", "heart": "round",
    "square": "polygon", "triangle": "polygon", "diamond": "polygon",
    "star": "symbol", "cross": "symbol",
}
SHAPE_NAMES: list[str] = list(SHAPES)

# colour name -> nominal RGB (drawn with a small per-object jitter; all pairwise distances > 90)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 35, 35), "green": (40, 175, 55), "blue": (45, 85, 235), "yellow": (235, 220, 45),
    "purple": (150, 55, 205), "orange": (250, 140, 20), "white": (240, 240, 240), "cyan": (40, 215, 225),
}
COLOUR_NAMES: list[str] = list(COLOURS)
COLOUR_JITTER = 14          # max per-channel deviation from the nominal RGB

# dark backgrounds: name used in long captions -> RGB
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (14, 14, 16), "dark grey": (48, 48, 50), "dark brown": (52, 36, 26),
    "navy": (18, 22, 58), "dark green": (18, 44, 28), "charcoal": (34, 34, 40),
}

# size -> radius range as a fraction of the image side (diameter small ~17-23 px, large ~28-35 px at 64 px: 2-3 and
# 3.5-4.5 patches of the patch-8 tiny ViT). At the earlier sizes (small ~1.6 patches) the tiny ViT learnt shape far
# slower, even supervised (200 steps: 50% vs 63% on single objects), and the base stayed shape-blind (issue 22).
# Larger "large" objects (0.27-0.34) left no room for a second object in a quarter of the 2-object scenes.
SIZES: dict[str, tuple[float, float]] = {"small": (0.136, 0.176), "large": (0.22, 0.27)}
SIZE_WORDS: dict[str, list[str]] = {"small": ["small", "little"], "large": ["large", "big"]}

# spatial relations (all asymmetric): canonical name -> surface phrases; the predicate is on box centres
RELATIONS: dict[str, list[str]] = {
    "left": ["to the left of", "left of"],
    "right": ["to the right of", "right of"],
    "above": ["above", "over"],
    "below": ["below", "under"],
}
OPPOSITE: dict[str, str] = {"left": "right", "right": "left", "above": "below", "below": "above"}
RELATION_MARGIN = 0.1       # a relation holds only if the centres differ by > margin * image side

NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
                "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen"]

# 3 x 3 position names for long captions (row, col)
POSITIONS = [["top left corner", "top middle", "top right corner"],
             ["left side", "centre", "right side"],
             ["bottom left corner", "bottom middle", "bottom right corner"]]

ZEROSHOT_TEMPLATES = ["a photo of a {}.", "an image of a {}.", "a {} on a dark background.",
                      "there is a {}.", "a picture of a {}."]


def plural(shape: str) -> str:
    return shape + "s"


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"
