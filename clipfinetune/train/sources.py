"""Batch sources for the loop (`loop.BatchSource`): the `pretrain` caption pairs.

`CaptionPairSource` serves a COCO captions file (the sample world's short captions) for training from scratch:
every epoch each image appears once, with one of its captions drawn at random, in a random order; both draws are
a function of (seed, epoch) only, so an interrupted epoch resumes exactly. Images are decoded and transformed once
and kept in memory (2,000 images of 64 px = 100 MB as fp32): the sample world is small and the pretrain budget is
minutes, so re-decoding JPEGs every epoch would only burn the CPU the model needs. Ranks split every global batch
(`batch_size * world_size` samples) into contiguous per-rank slices; the last partial batch is dropped.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from clipfinetune.data.readers.coco import captions_by_image, images_by_id, load_json
from clipfinetune.io import InputError, read_image


class CaptionPairSource:
    def __init__(self, captions_json: str | os.PathLike, images_dir: str | os.PathLike,
                 transform: Callable, tokenize: Callable, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        coco = load_json(captions_json)
        images = images_by_id(coco, captions_json)
        captions = captions_by_image(coco, captions_json)
        missing = [i for i in captions if i not in images]
        if missing:
            raise InputError(captions_json, missing[0], "caption refers to an image absent from images[]")
        self.image_ids = list(captions)
        if not self.image_ids:
            raise InputError(captions_json, None, "no captions")
        pixels, token_sets = [], []
        for image_id in self.image_ids:
            path = Path(images_dir) / images[image_id]["file_name"]
            pixels.append(transform(read_image(path, record=image_id)))
            token_sets.append(tokenize([text for _, text in captions[image_id]]))
        self.images = torch.stack(pixels)
        self.counts = torch.tensor([len(t) for t in token_sets])
        width = int(self.counts.max())
        self.tokens = torch.stack([torch.cat([t, t[:1].expand(width - len(t), -1)]) for t in token_sets])
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size

    def __len__(self) -> int:
        return len(self.image_ids) // (self.batch_size * self.world_size)

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.image_ids), generator=g)
        caption = (torch.rand(len(self.image_ids), generator=g) * self.counts).long()
        step = self.batch_size * self.world_size
        for i in range(start, len(self)):
            idx = order[i * step + self.rank * self.batch_size:i * step + (self.rank + 1) * self.batch_size]
            yield {"image": self.images[idx], "text": self.tokens[idx, caption[idx]]}
