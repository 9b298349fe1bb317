"""GOAL's LISM step 1: image segments -> boxes (docs/methods.md §3.1).

With a SAM checkpoint, segment-anything's automatic mask generator runs (GOAL uses SAM through HF's
mask-generation pipeline; we use the reference implementation). Checkpoints are loaded here with
`torch.load(weights_only=True)` — `segment_anything.build_sam` would call a bare `torch.load`, so the model
is built empty and the state dict loaded by us.

Without a checkpoint (the sample world) a documented CPU segmenter runs instead: scikit-image's
Felzenszwalb graph segmentation, one segment per connected region; the stage's metadata names it. A region that
touches the image border is background and dropped (the sample world keeps every object clear of the border): with
objects 2-5 patches wide the background splits into fragments of 1-80% of the image whose boxes span several
objects, and LISM matched sentences to them (accuracy 28% with them, 60% without; issue 22).

Either way a segment keeps its mask's bounding box (crops keep their background, as GOAL's
`keep_original_background` is an identity) and must cover 1%..80% of the image (GOAL's filter).
Boxes are xyxy in original-image pixels.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    box: tuple[float, float, float, float]  # xyxy, original pixels
    area_frac: float                        # mask area / image area


def mask_to_box(mask: np.ndarray) -> tuple[float, float, float, float] | None:
    """Tight xyxy box (pixel edges, so x1 - x0 = width in pixels) of a boolean mask; None if empty."""
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)


def filter_segments(masks, image_area: int, min_area: float, max_area: float) -> list[Segment]:
    """Masks -> boxes, keeping min_area <= mask area / image area <= max_area; largest first."""
    segments = []
    for mask in masks:
        frac = float(mask.sum()) / image_area
        box = mask_to_box(mask)
        if box is not None and min_area <= frac <= max_area:
            segments.append(Segment(box, frac))
    # Deterministic order: by area (desc), then position.
    return sorted(segments, key=lambda s: (-s.area_frac, s.box))


def felzenszwalb_masks(image: np.ndarray, scale: float = 200.0, sigma: float = 0.3,
                       min_size_frac: float = 0.005) -> list[np.ndarray]:
    """CPU segmenter: scikit-image Felzenszwalb regions, each split into connected components; components that
    touch the image border (background) are dropped."""
    from skimage.measure import label
    from skimage.segmentation import felzenszwalb

    h, w = image.shape[:2]
    regions = felzenszwalb(image, scale=scale, sigma=sigma, min_size=max(4, int(min_size_frac * h * w)))
    masks = []
    for region_id in np.unique(regions):
        components = label(regions == region_id, connectivity=1)
        for c in range(1, components.max() + 1):
            mask = components == c
            if not (mask[0].any() or mask[-1].any() or mask[:, 0].any() or mask[:, -1].any()):
                masks.append(mask)
    return masks


def build_sam(sam_type: str, checkpoint: str | None, device: str = "cpu"):
    """A segment-anything `Sam`; weights (if any) loaded with weights_only=True."""
    import torch
    from segment_anything import sam_model_registry

    sam = sam_model_registry[sam_type](checkpoint=None)
    if checkpoint:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        sam.load_state_dict(state)
    return sam.to(device).eval()


def sam_masks_fn(sam, **generator_kwargs) -> Callable[[np.ndarray], list[np.ndarray]]:
    from segment_anything import SamAutomaticMaskGenerator

    generator = SamAutomaticMaskGenerator(sam, **generator_kwargs)

    def masks(image: np.ndarray) -> list[np.ndarray]:
        return [m["segmentation"] for m in generator.generate(image)]

    return masks


def segment_image(image: np.ndarray, masks_fn: Callable[[np.ndarray], list[np.ndarray]],
                  min_area: float = 0.01, max_area: float = 0.8) -> list[Segment]:
    h, w = image.shape[:2]
    return filter_segments(masks_fn(image), h * w, min_area, max_area)

