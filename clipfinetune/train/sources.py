"""Batch sources for the loop (`loop.BatchSource`): the `pretrain` caption pairs.

`CaptionPairSource` serves a COCO captions file (the sample world's short captions) for training from scratch:
every epoch each image appears once, with one of its captions drawn at random, in a random order; both draws are
a function of (seed, epoch) only, so an interrupted epoch resumes exactly. Images are decoded and transformed once
and kept in memory: the sample world is small and the pretrain budget is minutes, so re-decoding JPEGs every epoch
would only burn the CPU the model needs. A transform that ends in `Normalize` after `ToTensor` (open_clip's) is
kept as the uint8 pixels before the normalisation (a quarter of fp32: 40,000 images of 64 px = 0.5 GB) and
normalised per batch with the same operations, so the batches are the ones the full transform gives. Ranks split every global batch
(`batch_size * world_size` samples) into contiguous per-rank slices; the last partial batch is dropped.

Grouped epochs (`group_key`, `grouped_epochs`): in the first `grouped_epochs` epochs every global batch holds images
of ONE group (the value of `group_key` in the image's COCO `images[]` entry; the sample world's pretraining split
puts each image's colour there), so within a batch only what differs inside the group (the shape) tells the
captions apart. Contrastive pretraining from scratch otherwise settles on colour, the fast feature, and the text
tower stops telling shape words apart (issue 22: cosine 0.998 between "a red circle" and "a red star"), after
which no gradient asks the image tower for shape. Later epochs are plain shuffles. Every epoch has the same number
of batches (the grouped count: whole batches per group), so the step count does not depend on the phase.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torchvision import transforms as T

from clipfinetune.data.coco import captions_by_image, images_by_id, load_json
from clipfinetune.io import InputError


class CaptionPairSource:
    def __init__(self, captions_json: str | os.PathLike, images_dir: str | os.PathLike,
                 transform: Callable, tokenize: Callable, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, group_key: str = "", grouped_epochs: int = 0):
        from PIL import Image

        coco = load_json(captions_json)
        images = images_by_id(coco, captions_json)
        captions = captions_by_image(coco, captions_json)
        missing = [i for i in captions if i not in images]
        if missing:
            raise InputError(captions_json, missing[0], "caption refers to an image absent from images[]")
        self.image_ids = list(captions)
        if not self.image_ids:
            raise InputError(captions_json, None, "no captions")
        to_pixels, self.normalize = split_normalize(transform)
        pixels, token_sets = [], []
        for image_id in self.image_ids:
            path = Path(images_dir) / images[image_id]["file_name"]
            try:
                with Image.open(path) as im:
                    pixels.append(to_pixels(im.convert("RGB")))
            except (OSError, ValueError) as e:
                raise InputError(path, image_id, f"cannot read image: {e}") from e
            token_sets.append(tokenize([text for _, text in captions[image_id]]))
        self.images = torch.stack(pixels)
        self.counts = torch.tensor([len(t) for t in token_sets])
        width = int(self.counts.max())
        self.tokens = torch.stack([torch.cat([t, t[:1].expand(width - len(t), -1)]) for t in token_sets])
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.grouped_epochs = grouped_epochs
        self.groups: list[torch.Tensor] = []
        if grouped_epochs:
            if not group_key:
                raise ValueError("grouped_epochs needs a group_key")
            members: dict = {}
            for i, image_id in enumerate(self.image_ids):
                if group_key not in images[image_id]:
                    raise InputError(captions_json, image_id, f"image has no {group_key!r} (grouped batches)")
                members.setdefault(images[image_id][group_key], []).append(i)
            self.groups = [torch.tensor(v) for _, v in sorted(members.items(), key=lambda kv: str(kv[0]))]

    def __len__(self) -> int:
        step = self.batch_size * self.world_size
        if self.groups:
            return sum(len(g) // step for g in self.groups)
        return len(self.image_ids) // step

    def _order(self, epoch: int, g: torch.Generator) -> torch.Tensor:
        """The epoch's image order: global batches one after another (grouped: each batch from one group)."""
        if epoch >= self.grouped_epochs:
            return torch.randperm(len(self.image_ids), generator=g)
        step = self.batch_size * self.world_size
        batches = []
        for members in self.groups:
            shuffled = members[torch.randperm(len(members), generator=g)]
            batches += list(shuffled[:len(members) // step * step].split(step))
        return torch.cat([batches[i] for i in torch.randperm(len(batches), generator=g)])

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = self._order(epoch, g)
        caption = (torch.rand(len(self.image_ids), generator=g) * self.counts).long()
        step = self.batch_size * self.world_size
        for i in range(start, len(self)):
            idx = order[i * step + self.rank * self.batch_size:i * step + (self.rank + 1) * self.batch_size]
            yield {"image": self.normalize(self.images[idx]), "text": self.tokens[idx, caption[idx]]}


def split_normalize(transform: Callable) -> tuple[Callable, Callable]:
    """(image -> stored tensor, stored batch -> model input). For a Compose whose last step is `Normalize` right
    after a to-tensor step: uint8 pixels (the to-tensor output x 255, exact for 8-bit images) and ToTensor's /255 +
    Normalize per batch. Any other transform: stored as it returns, identity per batch."""
    steps = getattr(transform, "transforms", [])
    if len(steps) < 2 or not isinstance(steps[-1], T.Normalize) or "ToTensor" not in type(steps[-2]).__name__:
        return transform, lambda batch: batch
    before, norm = T.Compose(steps[:-1]), steps[-1]
    mean = torch.tensor(norm.mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(norm.std, dtype=torch.float32).view(-1, 1, 1)

    def to_pixels(image) -> torch.Tensor:
        return torch.round(before(image) * 255).to(torch.uint8)

    def normalize(batch: torch.Tensor) -> torch.Tensor:
        return batch.float().div(255).sub_(mean).div_(std)

    return to_pixels, normalize
