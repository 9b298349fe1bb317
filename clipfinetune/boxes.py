"""The one place where boxes follow an image through a resize or a crop.

Boxes are xyxy in original-image pixels on disk. The model's transform squash-resizes the whole image
to the model's input size (no centre crop, as FineCLIP), so a box scales by (out_w / W, out_h / H).

Sizes follow each library's own order: an image's size is PIL's (W, H); the model's input size is
open_clip's `visual.image_size` = (H, W), as `ClipModel.image_size` returns it for a non-square input.
"""
from __future__ import annotations

import numpy as np
import torch


def resize_boxes(boxes, orig_wh: tuple[int, int], size: int | tuple[int, int]):
    """Map xyxy boxes from a (W, H) image onto the squash-resized model input of `size` (an int, or (H, W))."""
    out_h, out_w = (size, size) if isinstance(size, int) else size
    w, h = orig_wh
    scale = [out_w / w, out_h / h, out_w / w, out_h / h]
    if isinstance(boxes, torch.Tensor):
        return boxes * boxes.new_tensor(scale)
    return np.asarray(boxes, dtype=np.float32) * np.asarray(scale, dtype=np.float32)


def clip_box(box, orig_wh: tuple[int, int]):
    """Clamp an xyxy box to the image; returns None when nothing of positive area is left."""
    w, h = orig_wh
    x0, y0, x1, y1 = (float(v) for v in box)
    x0, x1 = max(0.0, min(x0, w)), max(0.0, min(x1, w))
    y0, y1 = max(0.0, min(y0, h)), max(0.0, min(y1, h))
    if x1 - x0 <= 0 or y1 - y0 <= 0:
        return None
    return [x0, y0, x1, y1]


def enlarge_box(box, scale: float, orig_wh: tuple[int, int]):
    """Grow a box about its centre by `scale` (FineCLIP crops regions at 1.5x), clamped to the image."""
    x0, y0, x1, y1 = (float(v) for v in box)
    cx, cy, hw, hh = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) * scale / 2, (y1 - y0) * scale / 2
    return clip_box([cx - hw, cy - hh, cx + hw, cy + hh], orig_wh)


def xywh_to_xyxy(box):
    x, y, w, h = box
    return [x, y, x + w, y + h]
