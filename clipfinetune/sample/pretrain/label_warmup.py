"""Label warm-up of the image tower before contrastive pretraining (stage `pretrain`, sample world): an objective the
one `Trainer` runs like a method (`LabelWarmup`: its module and loss; `LabelBatches`: its batches), not a loop of its
own, so it has the loop's precision, schedule, ranks, non-finite guard, logging and checkpoints.

The base CLIP stands in for a web-pretrained model. Trained from scratch by the contrastive loss alone, the tiny ViT
stays shape-blind within the pretraining budget: colour separates most captions of a batch, both towers settle on
it, and once the text tower maps "a red circle" and "a red star" to nearly the same point (cosine 0.998) no gradient
asks the image tower for shape (issue 22). Like CLIPs whose image tower starts from supervised pretraining (LiT,
Zhai et al. 2022), the image tower here first learns to say what each pretraining image holds: a throw-away linear
head on the (unnormalised) image embedding predicts the image's labels (the shapes and colours present) with a
softmax cross-entropy against the multi-hot row divided by its sum (1/k on each of k labels; Mahajan et al. 2018,
"Exploring the limits of weakly supervised pretraining", found it better than per-label binary losses, and here it
learns shape faster than binary cross-entropy); the contrastive stage then trains both towers from these weights.

Region term (`regions`, optional): the same head also reads each object's region feature (`pool_regions`: the
MaskCLIP dense map RoIAligned to the object's box, L2-normalised, times a learnt scale) and predicts that object's
labels. Contrastive pretraining trains only the pooled CLS embedding; without this term the dense features that
box classification and region-level methods read never learn what sits where (box top-1 26% on 8 shapes while
whole-image zero-shot reached 92%, #22). A detector-style start, as CLIPs initialised from supervised backbones
have; with regions every image takes part (the image term only on images with labels).

The Trainer's AdamW over open_clip's parameter groups (the head and the region scale without decay), warm-up and
cosine decay; only the image tower and the head train: the rest of the model (text tower, logit scale) is frozen while
the warm-up runs and thawed by `final_model` for the contrastive phase. One generator seeded by `seed` draws the head's
initial weights, then every step's batch (with replacement), so the result is a function of the inputs; each rank
takes its slice of every global batch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from clipfinetune.methods.base import Method


class LabelBatches:
    """The warm-up's `BatchSource`: `steps` global batches of `batch_size` images drawn with replacement from the
    images with at least one label, or from every image when `regions` (per image: boxes [k, 4] xyxy in input
    pixels, multi-hot labels [k, V]) adds the region term. `images` are stored batches that `normalize` turns into
    model input (`CaptionPairSource.images` / `.normalize`)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, *, steps: int, batch_size: int,
                 generator: torch.Generator, normalize: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch,
                 regions: list[tuple[torch.Tensor, torch.Tensor]] | None = None, rank: int = 0, world_size: int = 1):
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} label rows")
        self.has_label = labels.sum(1) > 0
        if not self.has_label.any():
            raise ValueError("no image has a label")
        if regions is not None and len(regions) != len(images):
            raise ValueError(f"{len(images)} images but {len(regions)} region lists")
        if batch_size % world_size:
            raise ValueError(f"the warm-up's global batch {batch_size} is not divisible by {world_size} ranks")
        pool = torch.arange(len(images)) if regions is not None else torch.nonzero(self.has_label).flatten()
        self.draws = pool[torch.randint(len(pool), (steps, batch_size), generator=generator)]   # [steps, global batch]
        self.images, self.labels, self.regions, self.normalize = images, labels, regions, normalize
        self.rank_batch = batch_size // world_size
        self.rank = rank

    def __len__(self) -> int:
        return len(self.draws)

    def epoch_length(self, epoch: int) -> int:           # loop.BatchSource: the warm-up is one epoch of `steps`
        return len(self.draws)

    def batches(self, epoch: int, start: int = 0) -> Iterator[dict]:
        for step in range(start, len(self.draws)):
            idx = self.draws[step, self.rank * self.rank_batch:(self.rank + 1) * self.rank_batch]
            batch = {"image": self.normalize(self.images[idx]), "labels": self.labels[idx]}
            if self.regions is not None:      # every object of the batch: [batch row, xyxy] and its labels
                batch["region_boxes"] = torch.cat(
                    [torch.cat([torch.full((len(self.regions[i][0]), 1), float(row)), self.regions[i][0]], 1)
                     for row, i in enumerate(idx.tolist())])
                batch["region_labels"] = torch.cat([self.regions[i][1] for i in idx.tolist()])
            yield batch


class LabelHead(nn.Module):
    """The model with the throw-away linear head over its image embedding (and the region term's cosine scale):
    forward(batch) -> the logits of the image labels (and of each object's labels) with their targets."""

    def __init__(self, model, head_weight: torch.Tensor, regions: bool):
        super().__init__()
        self.model, self.regions = model, regions
        self.head = nn.Linear(model.embed_dim, len(head_weight))
        with torch.no_grad():                           # the drawn init (`label_warmup`), a zero bias
            self.head.weight.copy_(head_weight)
            self.head.bias.zero_()
        # the region term's cosine-classifier scale (None when the term is off)
        self.region_scale = nn.Parameter(torch.tensor(10.0)) if regions else None

    def forward(self, batch: dict) -> dict:
        if not self.regions:
            return {"label_logits": self.head(self.model.encode_image(batch["image"], normalize=False)),
                    "labels": batch["labels"]}
        features = self.model.image_features(batch["image"], dense=True)   # one forward for both terms
        region = self.model.pool_regions(features["dense"], batch["region_boxes"])
        return {"label_logits": self.head(features["global_raw"]), "labels": batch["labels"],
                "region_logits": self.head(region * self.region_scale), "region_labels": batch["region_labels"]}


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against each multi-hot row divided by its sum (1/k on each of its k labels), averaged over the
    rows that hold a label (a row without one adds nothing), in fp32 whatever the forward's precision."""
    logits, target = logits.float(), target.float()
    mass = target.sum(1, keepdim=True)
    rows = -(target / mass.clamp(min=1e-12) * F.log_softmax(logits, dim=1)).sum(1)
    labelled = mass.squeeze(1) > 0
    return torch.where(labelled, rows, 0.0).sum() / labelled.sum().clamp(min=1)     # a select, not a product


class LabelLoss(nn.Module):
    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        out = {"labels": soft_cross_entropy(features["label_logits"], features["labels"])}
        if "region_logits" in features:
            out["region_labels"] = soft_cross_entropy(features["region_logits"], features["region_labels"])
        return out


class LabelWarmup(Method):
    """The warm-up as the Trainer sees a method: `LabelHead` to optimise, `LabelLoss` to minimise, the head in its
    own group without weight decay (at the warm-up's `lr`)."""
    name = "label_warmup"

    def __init__(self, head_weight: torch.Tensor, lr: float, regions: bool = False):
        super().__init__()
        self.head_weight, self.lr, self.regions = head_weight, lr, regions
        self.frozen: list[nn.Parameter] = []

    def unused_model_parameters(self, model) -> list[nn.Parameter]:
        image_tower = {id(p) for p in model.clip.visual.parameters()}
        return [p for p in model.parameters() if id(p) not in image_tower]

    def build(self, model) -> nn.Module:
        self.frozen = [p for p in self.unused_model_parameters(model) if p.requires_grad]
        for p in self.frozen:               # no gradient reaches them: frozen, so DDP and weight decay leave them be
            p.requires_grad_(False)
        return LabelHead(model, self.head_weight, self.regions)

    def final_model(self, module: nn.Module, model):
        """The model as the next phase takes it: what `build` froze trains again."""
        for p in self.frozen:
            p.requires_grad_(True)
        return model

    def loss(self) -> nn.Module:
        return LabelLoss()

    def param_groups(self, module: nn.Module) -> list[dict]:
        params = list(module.head.parameters()) + ([module.region_scale] if module.regions else [])
        return [{"name": "label_head", "params": params, "lr": self.lr, "weight_decay": 0.0}]


def label_warmup(images: torch.Tensor, labels: torch.Tensor, *, embed_dim: int, steps: int, batch_size: int, lr: float,
                 seed: int = 0, normalize: Callable[[torch.Tensor], torch.Tensor] = lambda batch: batch,
                 regions: list[tuple[torch.Tensor, torch.Tensor]] | None = None, rank: int = 0,
                 world_size: int = 1) -> tuple[LabelWarmup, LabelBatches]:
    """(the objective, its batches) for `Trainer(method, model, batches, cfg)` with `cfg.epochs == 1` and
    `cfg.lr == lr`: `steps` optimiser steps of the GLOBAL `batch_size` over (images, multi-hot labels [N, V]) for a
    model whose image embedding has `embed_dim` dimensions."""
    g = torch.Generator().manual_seed(seed)     # one stream: the head's init, then every step's draw
    head_weight = torch.randn((labels.shape[1], embed_dim), generator=g) * embed_dim ** -0.5
    batches = LabelBatches(images, labels, steps=steps, batch_size=batch_size, generator=g, normalize=normalize,
                           regions=regions, rank=rank, world_size=world_size)
    return LabelWarmup(head_weight, lr, regions is not None), batches
