"""FSC-CLIP (Oh et al., EMNLP 2024): the data and forward glue around `losses.fsc_clip.FscClipLoss`.

Data: a shard record with short captions (any source: COCO, image-text pairs; long-caption-only records are skipped).
Each step draws one caption with the loader's `rng` and FRESH rule negatives for it (`rule_negatives(caption, rng)`:
negclip swap, WordNet replace, bi-gram shuffle, docs/methods.md §2.2, `data/negatives/rules.py`, in the loader workers),
so every epoch sees new negatives, as the authors' loader does. Example:

    image      [3, S, S]
    text       [1+K, C]  row 0 the positive, row 1+k the negative of type NEGATIVE_TYPES[k]
    neg_valid  [K] bool  False where the generator gave nothing; that row then holds the empty text (SOT, EOT) as a
                         placeholder, which the loss masks out (-inf logit, no label mass)

Forward (`FscClipFeatures`): ONE vision forward (global + projected patch tokens, `image_features`) and ONE text
forward over the B*(1+K) texts (global + projected token states + token mask, `text_features`, trimmed to the
batch's longest text). The token states are zero-padded back to the context length, off the token mask, so that
gradient-accumulation micro-batches' features concatenate along dim 0 (the loss never scores masked positions).
With lambda_l = 0 neither patch nor token states are formed (`encode_image`/`encode_text` only pool CLS/EOT); with
lambda_g = lambda_l = 0 the negatives are not even encoded.

LoRA variant (FSC-CLIP's `--lora-rank 4`, docs/methods.md §2.4), off by default, not in dvc.yaml: `lora_rank > 0` puts
LoRA on both towers with the authors' init (`apply_lora(..., init="fsc_clip")`: alpha 1, patch-embed conv LoRA,
xavier-initialised q/k/v LoRA) and trains ONLY the LoRA weights (the logit scale is frozen, as the authors'
`mark_only_lora_as_trainable`). Decision: the 10x learning rate of the authors' LoRA runs (5e-5 vs 5e-6) is not a
multiplier here, because a method does not see `train.lr`: set `train.fsc_clip.lora_lr` (an absolute LR for the
LoRA group; FSC-CLIP: 10x the full fine-tuning LR), or `train.fsc_clip.lr`. `final_model` merges the LoRA weights
into the base weights, so the exported model is a plain CLIP.
"""
from __future__ import annotations

import random
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .base import CaptionUnits, Method

NEGATIVE_TYPES = ("negclip", "replace", "shuffle")      # FSC-CLIP's three generators, in the authors' order
PLACEHOLDER = ""                                        # the text of a missing negative (masked by neg_valid)


class FscClipFeatures(nn.Module):
    """forward(batch) -> the features dict of `FscClipLoss`."""

    def __init__(self, model, local: bool = True, negatives: bool = True):
        super().__init__()
        self.model, self.local, self.negatives = model, local, negatives

    def forward(self, batch: dict) -> dict:
        model = self.model
        text = batch["text"]                                         # [B, 1+K, C]
        b, c = text.shape[0], text.shape[1]
        features = {"logit_scale": model.clip.logit_scale.exp(), "neg_valid": batch["neg_valid"]}
        if self.local:
            image = model.image_features(batch["image"])
            features.update(image=image["global_"], patches=image["patches"])
            tf = model.text_features(text.flatten(0, 1))
            pad = text.shape[2] - tf["tokens"].shape[1]       # back to the context length (see the docstring)
            tokens = F.pad(tf["tokens"], (0, 0, 0, pad)).view(b, c, text.shape[2], -1)
            token_mask = F.pad(tf["mask"], (0, pad), value=False).view(b, c, text.shape[2])
            embeddings = tf["global_"].view(b, c, -1)
            features.update(text_tokens=tokens, text_mask=token_mask)
        else:
            features["image"] = model.encode_image(batch["image"], normalize=True)
            texts = text.flatten(0, 1) if self.negatives else text[:, 0]
            embeddings = model.encode_text(texts, normalize=True).view(b, c if self.negatives else 1, -1)
        features["text"] = embeddings[:, 0]
        if self.negatives:
            features["neg_text"] = embeddings[:, 1:]
        return features


class FscClipMethod(CaptionUnits, Method):
    name = "fsc_clip"
    terms: ClassVar[dict[str, str | None]] = {
        "contrastive": None, "global_hn": "lambda_g", "local_hn": "lambda_l"}
    train_keys = frozenset({"lora_rank", "lora_lr"})

    def __init__(self, lambda_g: float = 0.5, lambda_l: float = 0.5, focal_gamma: float = 2.0,
                 label_smoothing: float = 0.02, lhn_weighting: str = "minmax", lora_rank: int = 0,
                 lora_lr: float | None = None):
        self.lambda_g, self.lambda_l = float(lambda_g), float(lambda_l)
        self.focal_gamma, self.label_smoothing = float(focal_gamma), float(label_smoothing)
        self.lhn_weighting = lhn_weighting
        self.lora_rank = int(lora_rank)
        self.lora_lr = None if lora_lr is None else float(lora_lr)
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0 = full fine-tuning), got {lora_rank}")
        if self.lora_lr is not None and self.lora_rank == 0:
            raise ValueError("lora_lr is set but lora_rank is 0 (LoRA off)")

    def wants(self, record: dict) -> bool:
        return bool(record.get("captions"))

    def rule_negatives(self, caption: str, rng: random.Random) -> dict[str, str | None]:
        """FSC-CLIP's online negatives of `caption`, one per type of NEGATIVE_TYPES (None: that rule found none)."""
        from clipfinetune.data.negatives.rules import online_negatives

        return online_negatives(caption, rng)

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        caption = rng.choice(record["captions"])
        negatives = self.rule_negatives(caption, rng)
        found = [negatives.get(t) for t in NEGATIVE_TYPES]
        valid = [bool(n) for n in found]
        texts = [caption] + [n if ok else PLACEHOLDER for n, ok in zip(found, valid)]
        return {"image": ctx.transform(image), "text": ctx.tokenize(texts),
                "neg_valid": torch.tensor(valid, dtype=torch.bool)}

    def build(self, model) -> nn.Module:
        if self.lora_rank:
            from clipfinetune.models import apply_lora

            apply_lora(model, rank=self.lora_rank, init="fsc_clip", train_only_lora=True)
        return FscClipFeatures(model, local=self.lambda_l != 0, negatives=self.lambda_g != 0 or self.lambda_l != 0)

    def loss(self) -> nn.Module:
        from clipfinetune.losses.fsc_clip import FscClipLoss

        return FscClipLoss(self.lambda_g, self.lambda_l, self.focal_gamma, self.label_smoothing, self.lhn_weighting)

    def param_groups(self, module: nn.Module) -> list[dict]:
        if not self.lora_rank or self.lora_lr is None:
            return []
        params = [p for n, p in module.named_parameters() if p.requires_grad and n.endswith(("lora_A", "lora_B"))]
        return [{"name": "lora", "params": params, "lr": self.lora_lr}]

    def final_model(self, module: nn.Module, model):
        if self.lora_rank:
            from clipfinetune.models import has_lora, merge_lora

            if has_lora(model):
                merge_lora(model)
        return model
