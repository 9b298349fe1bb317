"""Batch sources for the loop (`loop.BatchSource`): the `pretrain` caption pairs.

`CaptionPairSource` serves reader records with short captions (`clipfinetune.data.readers`; the sample world's COCO
source) for training from scratch:
every epoch each image appears once, with one of its captions drawn at random, in a random order; both draws are
a function of (seed, epoch) only, so an interrupted epoch resumes exactly. Images are decoded and transformed once
and kept in memory (2,000 images of 64 px = 100 MB as fp32): the sample world is small and the pretrain budget is
minutes, so re-decoding JPEGs every epoch would only burn the CPU the model needs. Ranks split every global batch
(`batch_size * world_size` samples) into contiguous per-rank slices; the last partial batch is dropped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from clipfinetune.io import InputError


class CaptionPairSource:
    def __init__(self, records: list, transform: Callable, tokenize: Callable, batch_size: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1):
        records = [r for r in records if r.captions]
        if not records:
            raise InputError("pretrain sources", None, "no records with captions")
        self.image_ids = [r.image_id for r in records]
        pixels, token_sets = [], []
        for r in records:
            pixels.append(transform(r.read_image()))
            token_sets.append(tokenize(list(r.captions)))
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
