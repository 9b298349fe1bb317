"""Stand-ins for the training-loop tests (no tests here): a tiny open_clip CLIP behind the ClipModel methods the
plain CLIP method uses, and a deterministic DataLoader-backed batch source with the loop's resume contract."""
from __future__ import annotations

import open_clip
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from clipfinetune.train import TrainConfig

CONTEXT, VOCAB, SIZE = 8, 64, 16


class TinyClipModel(nn.Module):
    """The part of `clipfinetune.models.ClipModel` that `methods.clip` touches, around a ~50k-param CLIP."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.clip = open_clip.model.CLIP(
            embed_dim=16,
            vision_cfg=open_clip.model.CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=8, image_size=SIZE),
            text_cfg=open_clip.model.CLIPTextCfg(context_length=CONTEXT, vocab_size=VOCAB, width=32, heads=2, layers=1))

    def encode_image(self, x, normalize=True):
        return self.clip.encode_image(x, normalize=normalize)

    def encode_text(self, tokens, normalize=True):
        return self.clip.encode_text(tokens, normalize=normalize)


def toy_example(index: int, epoch: int, seed: int) -> dict:
    """Sample `index`: a fixed image, and one of its 3 fixed captions drawn per (seed, epoch, index)."""
    fixed = torch.Generator().manual_seed(10_000 + index)
    image = torch.randn(3, SIZE, SIZE, generator=fixed)
    captions = torch.randint(1, VOCAB, (3, CONTEXT), generator=fixed)
    pick = torch.randint(0, 3, (), generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch * 7919 + index))
    return {"image": image, "text": captions[pick]}


class _ToyEpoch(Dataset):
    def __init__(self, indices, epoch, seed, crash_at):
        self.indices, self.epoch, self.seed, self.crash_at = indices, epoch, seed, crash_at

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return toy_example(self.indices[i], self.epoch, self.seed)


class ToySource:
    """n samples, a new order per (seed, epoch), micro-batches of `batch_size`, `workers` loader processes.
    `crash_at=(epoch, micro_batch)` raises KeyboardInterrupt there (a killed run)."""

    def __init__(self, n=40, batch_size=8, workers=0, seed=0, crash_at=None):
        self.n, self.batch_size, self.workers, self.seed, self.crash_at = n, batch_size, workers, seed, crash_at

    def epoch_length(self, epoch):
        return self.n // self.batch_size

    def batches(self, epoch, start=0):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        indices = order[start * self.batch_size:self.epoch_length(epoch) * self.batch_size]
        loader = DataLoader(_ToyEpoch(indices, epoch, self.seed, self.crash_at), batch_size=self.batch_size,
                            num_workers=self.workers, generator=torch.Generator().manual_seed(0))
        for i, batch in enumerate(loader, start=start):
            if self.crash_at == (epoch, i):
                raise KeyboardInterrupt(f"killed at epoch {epoch} micro-batch {i}")
            yield batch


def fixed_batch(n=8, epoch=0, seed=0) -> dict:
    examples = [toy_example(i, epoch, seed) for i in range(n)]
    return {k: torch.stack([e[k] for e in examples]) for k in examples[0]}


def config(**overrides) -> TrainConfig:
    base = {"epochs": 1, "batch_size": 8, "lr": 1e-3, "warmup": 0, "wd": 0.1, "grad_clip": 1.0, "seed": 0}
    return TrainConfig(**{**base, **overrides})


def clip_step_losses(compiled: bool, **overrides):
    """A 10-step CLIP fit of TinyClipModel (2 epochs of 40 toy examples, batch 8) and each step's summed loss; the
    compile tests compare the eager and the compiled run's lists."""
    from clipfinetune.methods.clip import ClipMethod
    from clipfinetune.train import Trainer

    trainer = Trainer(ClipMethod(), TinyClipModel(), ToySource(n=40, batch_size=8),
                      config(epochs=2, lr=1e-3, compile=compiled, **overrides))
    losses, step = [], trainer.train_step

    def recorded(micro):
        values = step(micro)
        losses.append(sum(float(v) for k, v in values.items() if k.startswith("loss_")))
        return values

    trainer.train_step = recorded
    trainer.fit()
    return trainer, losses
