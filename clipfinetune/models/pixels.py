"""The model's preprocess split in two: 8-bit pixels on the CPU, normalisation where the model runs.

open_clip's preprocess (`open_clip.image_transform`) resizes a PIL image with PIL's bicubic, converts it to float
and normalises it, all in the loader's worker. Here the same geometry runs on a uint8 tensor with torchvision's
`transforms.v2` (its antialiased bicubic has a uint8 kernel; PIL's own resize is several times slower on the CPU and
was most of a training sample's time), the batch travels as uint8 (a quarter of float32's bytes through the
workers' shared memory, the pinned copy and the host-to-device transfer), and `ClipModel` normalises uint8 input
with its own mean/std on its device (`normalize_pixels`).

Equivalence (tests/test_pixels.py): the resize rounds to 8 bits as PIL's does, so the uint8 tensor is PIL's within
one grey level per pixel (two in a random crop, whose crop box is the same: the same torch draws); the
normalisation is torchvision's `ToTensor` + `Normalize` arithmetic (divide by 255, subtract the mean, divide by the
std, in float32), so equal uint8 pixels give bit-equal model input on the CPU.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

RESIZE_MODES = ("squash", "shortest")


def pixel_transform(size: tuple[int, int], resize_mode: str = "squash", interpolation: str = "bicubic",
                    train: bool = False) -> Callable:
    """PIL image -> uint8 [3, H, W] tensor with the geometry of `open_clip.image_transform(size, is_train=train,
    resize_mode=..., interpolation=...)`: "squash" resizes to `size` (H, W); "shortest" resizes the short side and
    centre-crops; `train` is open_clip's RandomResizedCrop (scale 0.9-1, its default ratio, bicubic)."""
    from torchvision.transforms import v2

    mode = v2.InterpolationMode(interpolation)
    size = (int(size[0]), int(size[1]))
    if train:
        geometry = [v2.RandomResizedCrop(size, scale=(0.9, 1.0), interpolation=v2.InterpolationMode.BICUBIC,
                                         antialias=True)]
    elif resize_mode == "squash":
        geometry = [v2.Resize(size, interpolation=mode, antialias=True)]
    elif resize_mode == "shortest":
        geometry = [v2.Resize(min(size), interpolation=mode, antialias=True), v2.CenterCrop(size)]
    else:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
    return v2.Compose([_RGB(), v2.PILToTensor(), *geometry])


class _RGB:
    """open_clip's `MaybeConvertMode` for RGB (a picklable callable, for loader workers)."""

    def __call__(self, image):
        return image if image.mode == "RGB" else image.convert("RGB")


def normalize_pixels(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32 (x / 255 - mean) / std, torchvision's `ToTensor` + `Normalize` arithmetic;
    `mean`, `std`: float32 [3, 1, 1] on the image's device."""
    return image.float().div(255).sub(mean).div(std)


def channel_stats(values: Sequence[float], device=None) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device).view(-1, 1, 1)
