"""HarmoCLIP (Zeng et al., arXiv 2511.22594): the data and forward glue around `losses.harmoclip.HarmoClipLoss`.

Data: a shard record with short captions and `word_regions` (records without them are skipped). Each step draws ONE
row (caption, word, box) with the loader's `rng` (with `train.epoch_unit: method` the loader hands over one row per
example, every row once an epoch: the paper's epoch over its word-region pairs); that caption is also the sample's
L_GC caption (supplementary §7:
"each caption contains only a single word aligned with one region"). The example holds

    image      [3, S, S]  ctx.transform(image) (squash resize, as FineCLIP)
    text       [C]        the row's caption, ctx.tokenize
    word_mask  [C] bool   the BPE positions of the word (ctx.token_span of its char span; multi-BPE words are
                          mean-pooled by the loss)
    box        [4]        the word's box, xyxy in INPUT pixels (ctx.resize_boxes)
    crop       [3, S, S]  the box enlarged 1.5x about its centre and clipped to the image (FineCLIP), cropped from
                          the original image and transformed (ctx.crop(image, box, scale=1.5)) for the teacher
    category   []         long id of the word's category (only read with `mask_same_category`)
    pair_valid [] bool    False when the box has no area left after clipping (the loss then drops the pair)

Forward (`HarmoClipFeatures`): ONE vision forward of the student gives the global embedding and MaskCLIP's dense
map (`image_features(dense=True)`, blocks 0..L-2 shared), the region feature is RoIAlign of the box over that map
(`pool_regions`), ONE text forward gives the global caption embedding and the projected token states; the frozen
teacher embeds the crops under `no_grad`. The text is encoded trimmed to the batch's longest caption (exact, see
`ClipModel`) and the token states are zero-padded back to the context length, so that the features of gradient-
accumulation micro-batches concatenate along dim 0 (the padding is outside every word mask).

Decisions the paper leaves open (besides those of the loss module):
- The GR teacher is a frozen copy of the model the run starts from (the base CLIP), registered as a submodule so
  it is checkpointed with the run, and kept in eval mode whatever the trainer's `.train()` says.
- `unlocked_vision_layers` (paper Table 6): -1 trains the whole vision tower; N >= 0 trains only the last N vision
  blocks (patch/positional/class embeddings, ln_pre and the earlier blocks frozen with the model layer's
  `freeze_vision_blocks`); ln_post and the projection always train. The text tower always trains.
- Category ids: the shard's `word_regions` rows carry the category NAME; its id is the row's `category_id` when
  present, else a stable 24-bit CRC of the name (the loss gathers groups as floats, exact up to 2^24). Two names
  colliding would only drop one extra off-diagonal pair, and only with `mask_same_category`.
- A box with no area after clipping (the word_regions stage already drops these) keeps the sample for L_GC
  with `pair_valid` False, a zero box and the whole image as the crop.
- `lexeme_projection_grad` (default False, eqs. 3-4 as we read them, see `losses/harmoclip.py`): the word token
  states reach L_LRC through a detached text projection, so the word-region gradient trains the text transformer
  but not the projection shared with the global text embedding. True restores the projected-token variant whose
  L_LRC gradient also trains the projection.
- Terms whose weight is 0 are not computed: with lambda_lrc = lambda_gr = 0 the run is plain CLIP on the same data.
"""
from __future__ import annotations

import random
import zlib
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from clipfinetune.boxes import clip_box

from .base import Method

CROP_SCALE = 1.5        # FineCLIP's teacher crop: cx +- 0.75 w, cy +- 0.75 h


def category_id(row: dict) -> int:
    """The row's `category_id`, else a stable 24-bit id of its category name (exact as a float32 group key)."""
    if row.get("category_id") is not None:
        return int(row["category_id"])
    return zlib.crc32(str(row.get("category", "")).encode("utf-8")) & 0xFFFFFF


class HarmoClipFeatures(nn.Module):
    """forward(batch) -> the features dict of `HarmoClipLoss` (student + frozen teacher)."""

    def __init__(self, model, unlocked_vision_layers: int = -1, need_lexeme: bool = True, need_teacher: bool = True,
                 lexeme_projection_grad: bool = False):
        super().__init__()
        from clipfinetune.models import freeze_vision_blocks, frozen_teacher

        self.model = model
        self.need_lexeme, self.need_teacher = need_lexeme, need_teacher
        self.lexeme_projection_grad = lexeme_projection_grad
        self.teacher = frozen_teacher(model) if need_teacher else None
        n_blocks = model.num_vision_blocks
        if unlocked_vision_layers != -1:
            if not 0 <= unlocked_vision_layers <= n_blocks:
                raise ValueError(f"unlocked_vision_layers must be -1 (all) or 0..{n_blocks}, "
                                 f"got {unlocked_vision_layers}")
            freeze_vision_blocks(model, n_blocks - unlocked_vision_layers)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.teacher is not None:
            self.teacher.eval()             # the teacher is a fixed function, never in train mode
        return self

    def forward(self, batch: dict) -> dict:
        model = self.model
        need_regions = self.need_lexeme or self.need_teacher
        image = model.image_features(batch["image"], dense=need_regions)
        features = {"image": image["global_"], "logit_scale": model.clip.logit_scale.exp()}
        if self.need_lexeme:
            text = model.text_features(batch["text"], detach_token_projection=not self.lexeme_projection_grad)
            # back to the full context (zeros, off the word mask): micro-batches' features must concatenate
            tokens = F.pad(text["tokens"], (0, 0, 0, batch["text"].shape[1] - text["tokens"].shape[1]))
            features.update(text=text["global_"], text_tokens=tokens, word_mask=batch["word_mask"])
        else:
            features["text"] = model.encode_text(batch["text"])
        if need_regions:
            features["region"] = model.pool_regions(image["dense"], list(batch["box"].float().unsqueeze(1)))
            features["pair_valid"] = batch["pair_valid"]
            features["category"] = batch["category"]
            features["word_mask"] = batch["word_mask"]
        if self.need_teacher:
            with torch.no_grad():
                features["region_teacher"] = self.teacher.encode_image(batch["crop"], normalize=True)
        return features


class HarmoClipMethod(Method):
    name = "harmoclip"
    terms: ClassVar[dict[str, str | None]] = {
        "contrastive": None, "lexeme_region": "lambda_lrc", "global_region": "lambda_gr"}
    epoch_unit = "word_region"      # the paper's epoch runs over its ~599K word-region pairs (one row each)

    def __init__(self, lambda_lrc: float = 1.0, lambda_gr: float = 1.0, unlocked_vision_layers: int = -1,
                 mask_same_category: bool = False, lexeme_projection_grad: bool = False):
        self.lambda_lrc, self.lambda_gr = float(lambda_lrc), float(lambda_gr)
        self.unlocked_vision_layers = int(unlocked_vision_layers)
        self.mask_same_category = bool(mask_same_category)
        self.lexeme_projection_grad = bool(lexeme_projection_grad)

    def prepared_tables(self) -> list[tuple[str, str]]:
        return [("word-region pairs", "word_regions")]

    def units_table(self) -> str:
        return "word_regions"

    def wants(self, record: dict) -> bool:
        return bool(record.get("word_regions")) and bool(record.get("captions"))

    def units(self, record: dict) -> int:
        return len(record["word_regions"])

    def unit_record(self, record: dict, unit: int) -> dict:
        return {**record, "word_regions": [record["word_regions"][unit]]}

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        row = rng.choice(record["word_regions"])
        caption = record["captions"][row["caption_index"]]
        tokens = ctx.tokenize([caption])[0]
        word_mask = torch.zeros(tokens.shape[0], dtype=torch.bool)
        start, end = row["char_span"]
        word_mask[ctx.token_span(caption, start, end)] = True
        clipped = clip_box(row["box"], image.size)
        if clipped is None:
            box, crop, valid = torch.zeros(4), ctx.transform(image), False
        else:
            box = torch.as_tensor(ctx.resize_boxes(torch.tensor([clipped], dtype=torch.float32), image.size))[0]
            crop, valid = ctx.crop(image, clipped, scale=CROP_SCALE), True
        return {"image": ctx.transform(image), "text": tokens, "word_mask": word_mask,
                "box": box.float(), "crop": crop, "category": torch.tensor(category_id(row), dtype=torch.long),
                "pair_valid": torch.tensor(valid)}

    def build(self, model) -> nn.Module:
        return HarmoClipFeatures(model, self.unlocked_vision_layers, need_lexeme=self.lambda_lrc != 0,
                                 need_teacher=self.lambda_gr != 0,
                                 lexeme_projection_grad=self.lexeme_projection_grad)

    def loss(self) -> nn.Module:
        from clipfinetune.losses.harmoclip import HarmoClipLoss

        return HarmoClipLoss(self.lambda_lrc, self.lambda_gr, self.mask_same_category)
