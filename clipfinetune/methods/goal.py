"""GOAL (Choi et al., CVPR 2025): the data and forward glue around `losses.goal.GoalLoss`.

Data: a shard record with a long caption (DOCCI; records with short captions only are skipped). Example:

    image        [3, S, S]   ctx.transform(image) (squash resize; GOAL's centre-crops, docs/methods.md §3.4 bug 2)
    text         [L]         the long caption, ctx.tokenize_long (L = 248, Long-CLIP context)
    and, unless the run is global-only (lambda_local = lambda_tsl = 0):
    local_image  [3, S, S]   the LISM box cropped from the original image (background kept, NOT enlarged), transformed
    local_text   [L]         the matched sentence, tokenized at 248
    box          [4]         the LISM box in INPUT pixels (ctx.resize_boxes of the original-pixel box)
    span_mask    [L] bool    the sentence's token positions inside the tokenized long caption
    local_valid  [] bool     the record has a local pair (`local_pair`, 0 or 1 entries)
    span_valid   [] bool     the sentence kept at least one token after the 248-token truncation

Forward (`GoalFeatures`): ONE vision forward over [images; crops] and ONE text forward over [long captions;
sentences] (the authors run a second forward per tower for the hidden states; `image_features`/`text_features`
return both from one). Region pooled = `pool_image_hidden`(mean of the pre-ln_post patch states under
`model.box_patch_mask(box)`); sentence pooled = `pool_text_hidden`(mean of the pre-ln_final long-caption states under
`span_mask`).

Decisions the paper leaves open / where we differ from the authors' code (docs/methods.md §3.2, §3.4):
- Box -> patches uses the model's OWN image size and patch size (`box_patch_mask`, every touched patch), on a box
  mapped by the same squash resize as the image: not the hard-coded 224/16, not the crop-size scaling (bugs 1-3).
- The span is the tokenizer's real span of the sentence's character span in the long caption (`token_span` at the
  248 context; the words' BPE tokens, no SOT, no trailing EOT): no off-by-one (bug 4). A span cut PARTLY by the
  truncation keeps its surviving tokens; a span entirely beyond it is `span_valid` False (the loss drops that
  sentence's text-side TSL term and counts it in `stats["n_tsl_text_dropped"]`).
- A record without a local pair (LISM found none, or the global image won; or its box has no area inside the
  image) is kept for L_global with `local_valid` False; its crop slot holds the whole image, its sentence slot the
  empty text, its box the whole image (finite placeholders that the loss never reads). Their crops still run through the
  towers (static shapes for DDP and the accumulation cache); the loss counts them in `stats["n_global_only"]`.
- Long-CLIP stretching in `build()`, GOAL's port: all 248 rows trainable (`freeze_kept=False`, docs/methods.md
  §0.1, §6.10); a model whose context is already 248 is left as it is (e.g. a Long-CLIP base).
- The loss's counts stay on the device in `GoalLoss.stats` after every call; the step never reads them (a host
  read would sync), tests do.
"""
from __future__ import annotations

import random
from typing import ClassVar

import torch
from torch import nn

from clipfinetune.boxes import clip_box

from .base import Method


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of hidden [B, N, W] over mask [B, N] (an empty mask gives a zero vector, never NaN)."""
    weights = mask.to(hidden.dtype)
    return torch.einsum("bn,bnw->bw", weights, hidden) / weights.sum(dim=1, keepdim=True).clamp(min=1.0)


def long_token_span(ctx, text: str, char_start: int, char_end: int) -> list[int]:
    """Positions of text[char_start:char_end]'s tokens in `ctx.tokenize_long([text])[0]`; truncated ones dropped.

    `models.text.token_span`'s rule (whole words; the tokens a word-aligned prefix adds), counted with the long
    tokenizer itself, so the span is right whatever context `ctx.token_span` was built for: a prefix's token count
    is its EOT position - 1 (EOT is the largest id; truncation keeps EOT in the last slot, which caps the count
    at L - 2, the last word slot, exactly as `token_span` drops truncated positions).
    """
    from clipfinetune.models.text import widen_to_words

    char_start, char_end = widen_to_words(text, char_start, char_end)
    before, through = ctx.tokenize_long([text[:char_start], text[:char_end]]).argmax(dim=1).tolist()
    return list(range(before, through))          # word i of the text sits at position 1 + i


class GoalFeatures(nn.Module):
    """forward(batch) -> the features dict of `GoalLoss`."""

    def __init__(self, model, local: bool = True):
        super().__init__()
        self.model, self.local = model, local

    def forward(self, batch: dict) -> dict:
        model = self.model
        features = {"logit_scale": model.clip.logit_scale.exp()}
        if not self.local:
            features.update(image=model.encode_image(batch["image"], normalize=True),
                            text=model.encode_text(batch["text"], normalize=True))
            return features
        b = batch["image"].shape[0]
        image = model.image_features(torch.cat([batch["image"], batch["local_image"]]))
        text = model.text_features(torch.cat([batch["text"], batch["local_text"]]))
        patch_mask = model.box_patch_mask(batch["box"].float()).to(image["hidden"].device)
        span_mask = batch["span_mask"].bool()[:, :text["hidden"].shape[1]]   # text states are trimmed
        features.update(
            image=image["global_"][:b], local_image=image["global_"][b:],
            text=text["global_"][:b], local_text=text["global_"][b:],
            region_pooled=model.pool_image_hidden(masked_mean(image["hidden"][:b], patch_mask)),          # eqs. 7-8
            sentence_pooled=model.pool_text_hidden(masked_mean(text["hidden"][:b], span_mask)),           # eqs. 9-10
            local_valid=batch["local_valid"].bool(), span_valid=batch["span_valid"].bool())
        return features


class GoalMethod(Method):
    name = "goal"
    caption_kind = "long"
    terms: ClassVar[dict[str, str | None]] = {
        "contrastive": "lambda_global", "local_contrastive": "lambda_local", "tsl_image": "lambda_tsl",
        "tsl_text": "lambda_tsl"}
    epoch_unit = "image"            # one long (DOCCI) caption per image: an epoch is one pass over the images

    def __init__(self, lambda_global: float = 1.0, lambda_local: float = 0.5, lambda_tsl: float = 1.0,
                 tsl_target: str = "diag"):
        self.lambda_global, self.lambda_local = float(lambda_global), float(lambda_local)
        self.lambda_tsl, self.tsl_target = float(lambda_tsl), tsl_target
        if tsl_target not in ("diag", "identity"):
            raise ValueError(f"tsl_target must be 'diag' or 'identity', got {tsl_target!r}")
        self.local = self.lambda_local != 0 or self.lambda_tsl != 0

    def wants(self, record: dict) -> bool:
        return bool(record.get("long_caption"))

    def prepared_tables(self) -> list[tuple[str, str]]:
        return [("local pairs", "lism")] if self.local else []    # global-only: the ablation reads none

    def tables_switched_off_by(self) -> tuple[str, ...]:
        return ("lambda_local", "lambda_tsl")

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        caption = record["long_caption"]
        whole = ctx.transform(image)
        example = {"image": whole, "text": ctx.tokenize_long([caption])[0]}
        if not self.local:
            return example
        length = example["text"].shape[0]
        pair = (record.get("local_pair") or [None])[0]
        box = clip_box(pair["box"], image.size) if pair is not None else None
        if pair is None or box is None:
            w, h = image.size
            return dict(example, local_image=whole, local_text=ctx.tokenize_long([""])[0],
                        box=torch.as_tensor(ctx.resize_boxes(torch.tensor([[0.0, 0.0, w, h]]), image.size))[0].float(),
                        span_mask=torch.zeros(length, dtype=torch.bool),
                        local_valid=torch.tensor(False), span_valid=torch.tensor(False))
        sentence = record["sentences"][pair["sentence_index"]]
        start, end = sentence["char_span"]
        span = long_token_span(ctx, caption, start, end)
        span_mask = torch.zeros(length, dtype=torch.bool)
        span_mask[span] = True
        return dict(example, local_image=ctx.crop(image, box), local_text=ctx.tokenize_long([sentence["text"]])[0],
                    box=torch.as_tensor(ctx.resize_boxes(torch.tensor([box], dtype=torch.float32),
                                                         image.size))[0].float(),
                    span_mask=span_mask, local_valid=torch.tensor(True), span_valid=torch.tensor(bool(span)))

    # goal_loss_finetuning.py: AdamW(model.parameters(), lr, weight_decay=0.05), no param groups, and no clamp of
    # logit_scale in the loop (docs/methods.md §3.2, §3.4 item 6, §6.8)
    def no_weight_decay(self, name: str, param: torch.Tensor) -> bool:
        return False                                          # every parameter decays

    def clamp(self, module: nn.Module) -> None:
        pass                                                  # the logit scale is never clamped

    def build(self, model) -> nn.Module:
        from clipfinetune.models import stretch_to_long

        stretch_to_long(model, freeze_kept=False)            # GOAL's port: all 248 rows train
        return GoalFeatures(model, local=self.local)

    def loss(self) -> nn.Module:
        from clipfinetune.losses.goal import GoalLoss

        return GoalLoss(self.lambda_global, self.lambda_local, self.lambda_tsl, self.tsl_target)
