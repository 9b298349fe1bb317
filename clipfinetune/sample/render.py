"""Pixels of a scene: a mildly textured dark background, anti-aliased polygons, mild noise, JPEG.

Deterministic: every random draw comes from the generator passed in, and the JPEG encoder settings
are fixed (quality 92, 4:4:4 chroma so small shapes keep their colour, no metadata).
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

from .scene import Scene

SUPERSAMPLE = 4
JPEG_KW = {"format": "JPEG", "quality": 92, "subsampling": 0, "optimize": False, "progressive": False}


def render(scene: Scene, rng: np.random.Generator) -> Image.Image:
    s, k = scene.size, SUPERSAMPLE
    bg = _background(scene.bg_rgb, s, rng)
    canvas = Image.fromarray(bg).resize((s * k, s * k), Image.NEAREST)
    draw = ImageDraw.Draw(canvas)
    for o in scene.objects:
        pts = [(o.polygon[i] * k, o.polygon[i + 1] * k) for i in range(0, len(o.polygon), 2)]
        draw.polygon(pts, fill=o.rgb)
    img = np.asarray(canvas.resize((s, s), Image.BOX), dtype=np.float32)
    img += rng.normal(0.0, 3.0, img.shape).astype(np.float32)          # mild sensor noise
    return Image.fromarray(np.clip(np.rint(img), 0, 255).astype(np.uint8))


def _background(rgb, s: int, rng: np.random.Generator) -> np.ndarray:
    """Plain dark colour with a gentle linear gradient and faint low-frequency mottling."""
    base = np.array(rgb, dtype=np.float32)
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float32) / s
    gx, gy = rng.uniform(-10, 10, 2)
    grad = (gx * (xx - 0.5) + gy * (yy - 0.5))[..., None]
    coarse = rng.normal(0.0, 3.0, (s // 8 + 1, s // 8 + 1)).astype(np.float32)
    mottle = np.asarray(Image.fromarray(coarse).resize((s, s), Image.BILINEAR))[..., None]
    return np.clip(base + grad + mottle, 0, 255).astype(np.uint8)


def jpeg_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, **JPEG_KW)
    return buf.getvalue()
