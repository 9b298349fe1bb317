"""The uint8 pixel path (models/pixels.py) gives the model the images open_clip's preprocess gives it.

The reference is open_clip's own `image_transform` (PIL bicubic, ToTensor, Normalize) of the same decoded JPEG, at
the model's preprocess config. Tolerance: both resizes are separable two-pass bicubic filters that round to 8 bits
after each pass, so a pixel may differ by the two roundings: after normalisation |new - reference| <= 2 grey levels
(2/255 / the channel's std: 0.030 for the OpenAI std), and the mean absolute difference is below a quarter of a grey
level (0.003-0.2 measured; the passes' order differs on some aspect ratios). A change a model would notice is far
above that: a bilinear instead of a bicubic filter, or re-encoding the JPEG at quality 95, moves these test images'
mean by 1-3 grey levels (the first test checks that the tolerance refuses the bilinear filter). The normalisation on
the model's side is the reference's arithmetic: equal pixels give bit-equal input. Boxes: the geometry is unchanged
(same output size, same squash resize), so a box maps as before and a crop of a box is the same pixels.
"""
from __future__ import annotations

import io
import random

import numpy as np
import open_clip
import pytest
import torch
from fixtures.methods import tiny_model
from PIL import Image, ImageDraw
from torchvision.transforms import Normalize

from clipfinetune.data.loader import ExampleContext
from clipfinetune.io import read_image
from clipfinetune.models.pixels import pixel_transform

GREY_LEVEL = 1 / 255


def photo_jpeg(size=(160, 120), seed=0) -> bytes:
    """A JPEG with smooth gradients, shapes and noise: every frequency a resize filter treats differently."""
    rng = np.random.default_rng(seed)
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h))
    base = np.stack([x * 255, y * 255, (1 - x) * 200], axis=-1) + rng.normal(0, 20, (h, w, 3))
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    r = random.Random(seed)
    for _ in range(5):
        x0, y0 = r.randrange(w - 20), r.randrange(h - 20)
        draw.ellipse([x0, y0, x0 + r.randrange(8, 60), y0 + r.randrange(8, 60)],
                     fill=tuple(r.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def reference(model, resize_mode: str = "squash", train: bool = False):
    cfg = model.preprocess_cfg
    if train:
        return open_clip.image_transform(tuple(cfg["size"]), is_train=True, mean=tuple(cfg["mean"]),
                                         std=tuple(cfg["std"]))
    return open_clip.image_transform(tuple(cfg["size"]), is_train=False, mean=tuple(cfg["mean"]),
                                     std=tuple(cfg["std"]), resize_mode=resize_mode,
                                     interpolation=cfg["interpolation"])


def assert_equivalent(model, pixels: torch.Tensor, expected: torch.Tensor, levels: int = 2) -> None:
    assert pixels.dtype == torch.uint8 and pixels.shape == expected.shape
    ours = model.image_input(pixels[None])[0].float()
    step = GREY_LEVEL / torch.tensor(model.preprocess_cfg["std"]).view(3, 1, 1)
    diff = (ours - expected).abs()
    assert bool((diff <= levels * step + 1e-6).all()), float((diff / step).max())
    assert float((diff / step).mean()) < 0.25, float((diff / step).mean())


@pytest.mark.parametrize("size", [(160, 120), (90, 150), (64, 64)])
@pytest.mark.parametrize("resize_mode", ["squash", "shortest"])
def test_eval_pixels_match_open_clip_preprocess(model, size, resize_mode):
    image = read_image(photo_jpeg(size, seed=size[0]))
    assert_equivalent(model, model.pixel_transform(resize_mode)(image), reference(model, resize_mode)(image))
    if size != (64, 64):                 # at the model's own size nothing is resized: every filter agrees
        bilinear = pixel_transform(tuple(model.preprocess_cfg["size"]), resize_mode, "bilinear")
        with pytest.raises(AssertionError):
            assert_equivalent(model, bilinear(image), reference(model, resize_mode)(image))


def test_training_pixels_match_open_clip_preprocess(model):
    """The loader's context (`ExampleContext.of_model`) against open_clip's preprocess; its random resized crop
    against open_clip's training preprocess under the same torch seed (the same crop box)."""
    image = read_image(photo_jpeg((160, 120), seed=1))
    assert_equivalent(model, ExampleContext.of_model(model).transform(image), reference(model)(image))
    crops = ExampleContext.of_model(model, random_geometry=True).transform
    for seed in range(3):
        torch.manual_seed(seed)
        ours = crops(image)
        torch.manual_seed(seed)
        assert_equivalent(model, ours, reference(model, train=True)(image))


def test_box_crop_and_box_mapping_unchanged(model):
    """A region's crop (HarmoCLIP, GOAL) is the reference transform of the same PIL crop; its box maps by the squash
    resize's scale as before (the input size did not change)."""
    image = read_image(photo_jpeg((160, 120), seed=2))
    ctx = ExampleContext.of_model(model)
    assert_equivalent(model, ctx.crop(image, (20, 10, 90, 70)), reference(model)(image.crop((20, 10, 90, 70))))
    s = model.image_size
    torch.testing.assert_close(ctx.resize_boxes([[20, 10, 90, 70]], image.size),
                               torch.tensor([[20 * s / 160, 10 * s / 120, 90 * s / 160, 70 * s / 120]]))


def test_model_normalises_uint8_as_open_clip_does(model):
    """uint8 input is normalised on the model's side with ToTensor + Normalize's arithmetic: the same embedding,
    bit for bit on the CPU, as the float input of those pixels."""
    pixels = model.pixel_transform()(read_image(photo_jpeg((160, 120), seed=3)))
    cfg = model.preprocess_cfg
    as_float = Normalize(cfg["mean"], cfg["std"])(pixels.float() / 255)
    with torch.no_grad():
        assert torch.equal(model.encode_image(pixels[None]), model.encode_image(as_float[None]))
        assert torch.equal(model.image_features(pixels[None])["patches"],
                           model.image_features(as_float[None])["patches"])
        assert torch.equal(model.dense_features(pixels[None]), model.dense_features(as_float[None]))
