"""Scene records: which shapes an image holds, where, in which colour and size.

A scene is the ground truth everything else is derived from (pixels, boxes, captions, negatives).
Shapes are polygons in pixel coordinates (a ring is one "keyhole" polygon: outer circle, a zero-width
slit, inner circle reversed), so the drawn object, the COCO polygon and its box agree exactly.
Objects never overlap: their boxes keep a 1 px gap.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .vocab import (
    BACKGROUNDS,
    COLOUR_JITTER,
    COLOUR_NAMES,
    COLOURS,
    OPPOSITE,
    POSITIONS,
    RELATION_MARGIN,
    SHAPE_NAMES,
    SIZES,
)


@dataclass
class Obj:
    shape: str
    colour: str
    size: str                       # "small" | "large"
    rgb: tuple[int, int, int]       # drawn colour (nominal + jitter)
    cx: float
    cy: float
    radius: float
    angle: float                    # degrees
    polygon: list[float] = field(default_factory=list)   # flat [x0, y0, x1, y1, ...], pixels
    bbox: list[float] = field(default_factory=list)      # xyxy, pixels

    @property
    def key(self) -> tuple[str, str]:
        return self.colour, self.shape


@dataclass
class Scene:
    image_id: str                   # stable id (file stem)
    size: int
    background: str
    objects: list[Obj]
    bg_rgb: tuple[int, int, int] = (0, 0, 0)

    def record(self) -> dict:
        objs = [{"shape": o.shape, "colour": o.colour, "size": o.size, "rgb": list(o.rgb), "cx": o.cx,
                 "cy": o.cy, "radius": o.radius, "angle": o.angle, "bbox": o.bbox} for o in self.objects]
        return {"image_id": self.image_id, "size": self.size, "background": self.background, "objects": objs}

    @classmethod
    def from_record(cls, rec: dict) -> Scene:
        """The inverse of `record` (a line of scenes.jsonl): polygons and the background's RGB are not recorded."""
        objs = [Obj(shape=o["shape"], colour=o["colour"], size=o["size"], rgb=tuple(o["rgb"]), cx=o["cx"], cy=o["cy"],
                    radius=o["radius"], angle=o["angle"], bbox=o["bbox"]) for o in rec["objects"]]
        return cls(rec["image_id"], rec["size"], rec["background"], objs)


# ---------------------------------------------------------------- geometry

def shape_polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> np.ndarray:
    """Outline of `shape` centred at (cx, cy) with half-extent ~r, rotated by `angle` degrees."""
    if shape == "circle":
        pts = [(r * math.cos(t), r * math.sin(t)) for t in _angles(32)]
    elif shape == "ring":
        outer = [(r * math.cos(t), r * math.sin(t)) for t in _angles(32)]
        inner = [(0.55 * r * math.cos(t), 0.55 * r * math.sin(t)) for t in _angles(32)]
        pts = outer + [outer[0]] + [inner[0]] + inner[::-1] + [inner[0]]
    elif shape == "square":
        h = 0.85 * r
        pts = [(-h, -h), (h, -h), (h, h), (-h, h)]
    elif shape == "diamond":
        pts = [(0, -r), (0.72 * r, 0), (0, r), (-0.72 * r, 0)]
    elif shape == "triangle":
        pts = [(0, -r), (0.95 * r, 0.8 * r), (-0.95 * r, 0.8 * r)]
    elif shape == "star":
        pts = [((r if i % 2 == 0 else 0.45 * r) * math.cos(t), (r if i % 2 == 0 else 0.45 * r) * math.sin(t))
               for i, t in enumerate(_angles(10, start=-math.pi / 2))]
    elif shape == "cross":
        a, w = r, 0.34 * r
        pts = [(-w, -a), (w, -a), (w, -w), (a, -w), (a, w), (w, w), (w, a), (-w, a), (-w, w), (-a, w),
               (-a, -w), (-w, -w)]
    elif shape == "heart":
        raw = [(16 * math.sin(t) ** 3, -(13 * math.cos(t) - 5 * math.cos(2 * t) - 2 * math.cos(3 * t)
                                         - math.cos(4 * t))) for t in _angles(40)]
        pts = [(x * r / 16.5, (y + 2.5) * r / 16.5) for x, y in raw]
    else:
        raise ValueError(f"unknown shape {shape!r}")
    p = np.asarray(pts, dtype=np.float64)
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    return np.stack([cx + p[:, 0] * c - p[:, 1] * s, cy + p[:, 0] * s + p[:, 1] * c], axis=1)


def _angles(n: int, start: float = 0.0) -> list[float]:
    return [start + 2 * math.pi * i / n for i in range(n)]


def _bbox(pts: np.ndarray) -> list[float]:
    return [float(v) for v in (*pts.min(0), *pts.max(0))]


# ---------------------------------------------------------------- sampling

def make_obj(rng: np.random.Generator, shape: str, colour: str, size: str, cx: float, cy: float,
             radius: float) -> Obj:
    angle = 0.0 if shape in ("circle", "ring") else float(rng.uniform(-12, 12))
    base = np.array(COLOURS[colour])
    rgb = tuple(int(v) for v in np.clip(base + rng.integers(-COLOUR_JITTER, COLOUR_JITTER + 1, 3), 0, 255))
    pts = shape_polygon(shape, cx, cy, radius, angle)
    o = Obj(shape, colour, size, rgb, round(cx, 2), round(cy, 2), round(radius, 2), round(angle, 2))
    pts = np.round(pts, 2)
    o.polygon = pts.reshape(-1).tolist()
    o.bbox = _bbox(pts)
    return o


def place(rng: np.random.Generator, specs: list[tuple[str, str, str]], size: int, grid: bool = False,
          tries: int = 80) -> list[Obj]:
    """Place (shape, colour, size) specs without overlap. A spec that does not fit as "large" is tried
    as "small"; one that does not fit at all is dropped (the scene simply holds fewer objects)."""
    if grid:
        return _place_grid(rng, specs, size)
    objs: list[Obj] = []
    for shape, colour, sz in specs:
        for attempt_size in ([sz, "small"] if sz == "large" else [sz]):
            o = _try_place(rng, shape, colour, attempt_size, size, objs, tries)
            if o is not None:
                objs.append(o)
                break
    return objs


def _try_place(rng, shape, colour, sz, size, objs, tries) -> Obj | None:
    lo, hi = SIZES[sz]
    for _ in range(tries):
        r = float(rng.uniform(lo, hi)) * size
        cx, cy = rng.uniform(r + 1, size - r - 1, 2)
        # cheap test on the unrotated extent (+ slack for rotation) before building the object
        if any(_gap([cx - 1.1 * r, cy - 1.1 * r, cx + 1.1 * r, cy + 1.1 * r], p.bbox) < 1.0 for p in objs):
            continue
        o = make_obj(rng, shape, colour, sz, float(cx), float(cy), r)
        x0, y0, x1, y1 = o.bbox
        if x0 < 0.5 or y0 < 0.5 or x1 > size - 0.5 or y1 > size - 0.5:
            continue
        if all(_gap(o.bbox, p.bbox) >= 1.0 for p in objs):
            return o
    return None


def _place_grid(rng, specs, size) -> list[Obj]:
    """Crowded scenes: one small object per cell of a k x k grid (k = ceil(sqrt(n)))."""
    k = max(2, math.ceil(math.sqrt(len(specs))))
    cell = size / k
    cells = rng.permutation(k * k)[: len(specs)]
    lo, hi = SIZES["small"]
    objs = []
    for (shape, colour, _), c in zip(specs, cells):
        r = min(float(rng.uniform(lo, hi)) * size, cell / 2 - 1.2)
        slack = max(0.0, cell / 2 - r - 1.0)
        cx = (c % k + 0.5) * cell + float(rng.uniform(-slack, slack))
        cy = (c // k + 0.5) * cell + float(rng.uniform(-slack, slack))
        objs.append(make_obj(rng, shape, colour, "small", cx, cy, r))
    return objs


def _gap(a, b) -> float:
    """Gap between two xyxy boxes (negative when they overlap)."""
    return max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])


def random_specs(rng: np.random.Generator, n: int, p_large: float = 0.4, p_pair: float = 0.25,
                 unique: bool = False) -> list[tuple[str, str, str]]:
    """n (shape, colour, size) specs. Unless `unique`, with probability p_pair one (colour, shape) occurs
    twice (for plural captions: "two red circles")."""
    specs: list[tuple[str, str, str]] = []
    seen: set[tuple[str, str]] = set()
    while len(specs) < n:
        if not unique and specs and len(specs) == n - 1 and rng.random() < p_pair:
            shape, colour, _ = specs[int(rng.integers(len(specs)))]
            if sum(1 for s in specs if s[:2] == (shape, colour)) == 1:
                specs.append((shape, colour, "large" if rng.random() < p_large else "small"))
                continue
        shape = SHAPE_NAMES[int(rng.integers(len(SHAPE_NAMES)))]
        colour = COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
        if (shape, colour) in seen:
            continue
        seen.add((shape, colour))
        specs.append((shape, colour, "large" if rng.random() < p_large else "small"))
    return specs


def random_background(rng: np.random.Generator) -> str:
    names = list(BACKGROUNDS)
    return names[int(rng.integers(len(names)))]


def new_scene(image_id: str, size: int, background: str, objects: list[Obj]) -> Scene:
    return Scene(image_id, size, background, objects, BACKGROUNDS[background])


# ---------------------------------------------------------------- relations and positions

def holds(rel: str, a: Obj, b: Obj, size: int) -> bool:
    """Robust spatial relation "a <rel> b" on box centres (y grows downwards)."""
    m = RELATION_MARGIN * size
    if rel == "left":
        return a.cx + m < b.cx
    if rel == "right":
        return a.cx > b.cx + m
    if rel == "above":
        return a.cy + m < b.cy
    if rel == "below":
        return a.cy > b.cy + m
    raise ValueError(rel)


def true_relations(a: Obj, b: Obj, size: int) -> list[str]:
    return [r for r in OPPOSITE if holds(r, a, b, size)]


def false_relations(a: Obj, b: Obj, size: int) -> list[str]:
    """Relations that are robustly false for (a, b): the opposites of robustly true ones."""
    return [OPPOSITE[r] for r in true_relations(a, b, size)]


def position_name(o: Obj, size: int) -> str:
    col = min(2, int(3 * o.cx / size))
    row = min(2, int(3 * o.cy / size))
    return POSITIONS[row][col]


def groups(objs: list[Obj]) -> dict[tuple[str, str], list[Obj]]:
    out: dict[tuple[str, str], list[Obj]] = {}
    for o in objs:
        out.setdefault(o.key, []).append(o)
    return out
