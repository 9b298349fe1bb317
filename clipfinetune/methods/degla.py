"""DeGLA (ACM MM 2025): the data, forward and EMA glue around `losses.degla.DeglaLoss`.

Data: a shard record with short captions whose `negatives` (from the `negatives` stage: entries {caption_index, type,
texts}) cover at least one caption. Each step draws, with the loader's `rng`, one caption that has negatives (with
`train.epoch_unit: method` the loader hands over one such caption per example, each once an epoch), and
takes its K = 4 negatives (DeGLA's `enhanced[0..3]`). Example:

    image      [3, S, S]
    text       [1+K, C]  row 0 the caption, rows 1..K its negatives
    neg_valid  [K] bool  False for a slot the negatives stage could not fill; that row holds the empty text
                         (SOT, EOT) as a placeholder, masked by the loss (-inf, never a zero vector)

Decisions the paper leaves open:
- Slot order: the caption's negative entries are flattened type by type in the fixed order of `TYPE_ORDER` (the
  negatives stage's slot order: reshuffle, swap, replace adjectives, replace nouns; a type the stage filled twice
  keeps its texts' order; unknown types last, by name), then cut to K. The loss treats the K slots alike, so the
  order only makes the example a deterministic function of (record, rng).
- Only captions with >= 1 negative are drawn (a caption without any would add nothing but L_base, as plain CLIP);
  a caption with fewer than K keeps its valid ones.
- The EMA teacher is a copy of the model the run starts from (DeGLA: the same pre-trained weights), registered as a
  submodule so checkpoints carry it, frozen, kept in eval mode, run under `no_grad` on the same images and the
  same B*(1+K) texts as the student; `after_step` moves it by t <- alpha t + (1 - alpha) s (`ema_update`). It is
  computed only for the terms that read it: with lambda_distill = 0 only the teacher's positive texts (for L_TGC)
  are encoded; with lambda_tgc = lambda_distill = 0 the teacher is not run at all (it is still EMA'd).
- Images use the model's squash-resize transform (the sample world trains without augmentation; DeGLA's
  RandomResizedCrop(0.9, 1) is not applied).
"""
from __future__ import annotations

import random
from typing import ClassVar

import torch
from torch import nn

from .base import Method

K = 4                                                   # negatives per caption (DeGLA's --neg_text 4)
TYPE_ORDER = ("reshuffle", "swap_nouns", "swap_adjectives", "replace_adjectives", "replace_nouns")
PLACEHOLDER = ""


def caption_negatives(record: dict) -> dict[int, list[str]]:
    """caption_index -> its negative texts, flattened in TYPE_ORDER (unknown types after, by name)."""
    rank = {t: i for i, t in enumerate(TYPE_ORDER)}
    entries = sorted(record.get("negatives") or [],
                     key=lambda e: (rank.get(e["type"], len(rank)), e["type"]))   # stable: keeps a type's order
    out: dict[int, list[str]] = {}
    for entry in entries:
        texts = [t for t in entry.get("texts") or [] if t]
        if texts:
            out.setdefault(int(entry["caption_index"]), []).extend(texts)
    n_captions = len(record.get("captions") or [])
    return {i: texts for i, texts in out.items() if 0 <= i < n_captions}


class DeglaFeatures(nn.Module):
    """Student + EMA teacher; forward(batch) -> the features dict of `DeglaLoss`."""

    def __init__(self, model, teacher_text: bool = True, teacher_all: bool = True):
        super().__init__()
        from clipfinetune.models import ema_teacher

        self.model = model
        self.teacher = ema_teacher(model)
        self.teacher_text, self.teacher_all = teacher_text or teacher_all, teacher_all

    def train(self, mode: bool = True):
        super().train(mode)
        self.teacher.eval()
        return self

    @staticmethod
    def _encode(model, image: torch.Tensor | None, text: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        b, c = text.shape[0], text.shape[1]
        texts = model.encode_text(text.flatten(0, 1), normalize=True).view(b, c, -1)
        return (model.encode_image(image, normalize=True) if image is not None else None), texts

    def forward(self, batch: dict) -> dict:
        image, text = batch["image"], batch["text"]                 # [B, 3, S, S], [B, 1+K, C]
        student_image, student_text = self._encode(self.model, image, text)
        features = {"image": student_image, "text": student_text[:, 0], "neg_text": student_text[:, 1:],
                    "neg_valid": batch["neg_valid"], "logit_scale": self.model.clip.logit_scale.exp()}
        with torch.no_grad():
            if self.teacher_all:
                teacher_image, teacher_text = self._encode(self.teacher, image, text)
                features.update(teacher_image=teacher_image, teacher_text=teacher_text[:, 0],
                                teacher_neg_text=teacher_text[:, 1:])
            elif self.teacher_text:
                features["teacher_text"] = self._encode(self.teacher, None, text[:, :1])[1][:, 0]
        return features


class DeglaMethod(Method):
    name = "degla"
    terms: ClassVar[dict[str, str | None]] = {
        "contrastive": None, "igc": "lambda_igc", "tgc": "lambda_tgc", "distill": "lambda_distill"}
    epoch_unit = "caption"          # the paper's epoch runs over the ~414K COCO train2014 captions

    def __init__(self, lambda_igc: float = 0.1, lambda_tgc: float = 0.1, lambda_distill: float = 0.005,
                 ema_alpha: float = 0.9996, tgc_logit_scale: float = 10.0):
        self.lambda_igc, self.lambda_tgc = float(lambda_igc), float(lambda_tgc)
        self.lambda_distill, self.ema_alpha = float(lambda_distill), float(ema_alpha)
        self.tgc_logit_scale = float(tgc_logit_scale)
        if not 0.0 <= self.ema_alpha <= 1.0:
            raise ValueError(f"ema_alpha must be in [0, 1], got {ema_alpha}")

    def prepared_tables(self) -> list[tuple[str, str]]:
        return [("hard negatives", "negatives")]

    def wants(self, record: dict) -> bool:
        return bool(caption_negatives(record))

    def units(self, record: dict) -> int:
        return len(caption_negatives(record))          # the captions that have negatives (the ones drawn)

    def unit_record(self, record: dict, unit: int) -> dict:
        index = sorted(caption_negatives(record))[unit]
        return {**record, "negatives": [e for e in record["negatives"] if int(e["caption_index"]) == index]}

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        negatives = caption_negatives(record)
        index = rng.choice(sorted(negatives))
        found = negatives[index][:K]
        texts = [record["captions"][index]] + found + [PLACEHOLDER] * (K - len(found))
        return {"image": ctx.transform(image), "text": ctx.tokenize(texts),
                "neg_valid": torch.arange(K) < len(found)}

    def build(self, model) -> nn.Module:
        return DeglaFeatures(model, teacher_text=self.lambda_tgc != 0, teacher_all=self.lambda_distill != 0)

    def loss(self) -> nn.Module:
        from clipfinetune.losses.degla import DeglaLoss

        return DeglaLoss(self.lambda_igc, self.lambda_tgc, self.lambda_distill, self.tgc_logit_scale)

    def after_step(self, module: nn.Module) -> None:
        from clipfinetune.models import ema_update

        ema_update(module.teacher, module.model, self.ema_alpha)
