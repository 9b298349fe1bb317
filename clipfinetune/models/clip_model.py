"""`ClipModel`: an open_clip CLIP (ViT) with the token-, patch- and region-level views the methods need.

Towers: open_clip's own ViT, or open_clip's timm tower (EVA02-CLIP, e.g. `EVA02-B-16`, whose text tower sits in
`clip.text`), through one contract (`towers.py`): the code below never names a tower's modules.

`model.clip` is the untouched open_clip model (its `encode_image`/`encode_text` keep working for
open_clip tools); everything here runs over its own modules, without a fork.

Decisions the papers leave open:
- Image tokens come from open_clip's `forward_intermediates` (one forward gives the pooled embedding,
  the last block's pre-`ln_post` tokens, and, with `dense=True`, the input of the last block for
  MaskCLIP's dense path). `patches` = the tower's head of those tokens (ViT: ln_post then proj; EVA02: norm then
  its projection head), not normalised, prefix (CLS) tokens excluded (FSC-CLIP).
- Text is encoded only up to the batch's longest sequence (its EOT): with CLIP's causal mask no
  position up to EOT sees later padding, so the trimmed result is exact and costs L_max/77 of the work.
  `text_features` therefore returns `tokens`/`mask`/`hidden` of length L_max (<= context length); the
  positions are unchanged, so a `token_span` always indexes inside them. `trim=False` pads to the context.
- The token mask keeps EOT and drops SOT and padding (FSC-CLIP `model.py` L330-333).
- `transform` squash-resizes to the model's input size (no centre crop, FineCLIP), so boxes map by
  `boxes.resize_boxes`; its mean/std/interpolation are the model's own preprocess config.
- Image input is either open_clip's normalised float tensor or uint8 pixels (`pixel_transform`, the same geometry
  without the normalisation), which the model normalises on its own device (`pixels.py`): the loader and the
  evaluation send uint8.
"""
from __future__ import annotations

import contextlib
import copy

import open_clip
import torch
import torch.nn.functional as F
from open_clip.transformer import QuickGELU
from torch import nn

from . import regions
from .pixels import channel_stats, normalize_pixels, pixel_transform
from .text import get_tokenizer, token_span
from .towers import text_pool, text_tower, vision_tower

PAD_ID = 0      # open_clip's SimpleTokenizer pads with 0


class ClipModel(nn.Module):
    def __init__(self, clip: nn.Module, model_cfg: dict, tokenizer_source: str, precision: str = "fp32"):
        super().__init__()
        _check_supported(clip)
        self.clip = clip
        self.model_cfg = copy.deepcopy(model_cfg)
        self.tokenizer_source = tokenizer_source
        self.precision = precision
        self.input_dtype = open_clip.get_input_dtype(precision) or torch.float32
        preprocess = open_clip.get_model_preprocess_cfg(clip)
        self.preprocess_cfg = {"size": list(clip.visual.image_size), "mode": "RGB",
                               "mean": list(preprocess["mean"]), "std": list(preprocess["std"]),
                               "interpolation": preprocess.get("interpolation", "bicubic"), "resize_mode": "squash"}
        self._reused: dict | None = None          # `reusing_features`: (kind, id(input), options) -> (input, result)
        # uint8 input is normalised with these (not in the state dict: they follow from preprocess_cfg)
        device = next(clip.parameters()).device
        self.register_buffer("pixel_mean", channel_stats(preprocess["mean"], device), persistent=False)
        self.register_buffer("pixel_std", channel_stats(preprocess["std"], device), persistent=False)
        self.transform = open_clip.image_transform(
            tuple(clip.visual.image_size), is_train=False, mean=tuple(preprocess["mean"]),
            std=tuple(preprocess["std"]), resize_mode="squash", interpolation=self.preprocess_cfg["interpolation"])

    def eval_transform(self, resize_mode: str = "squash"):
        """The model's preprocess with another resize: "squash" (= `transform`), or open_clip's "shortest" (short
        side to the input size, then centre crop: the official retrieval / zero-shot / compositionality scripts)."""
        if resize_mode == "squash":
            return self.transform
        cfg = self.preprocess_cfg
        return open_clip.image_transform(tuple(cfg["size"]), is_train=False, mean=tuple(cfg["mean"]),
                                         std=tuple(cfg["std"]), resize_mode=resize_mode,
                                         interpolation=cfg["interpolation"])

    def pixel_transform(self, resize_mode: str = "squash", train: bool = False):
        """PIL image -> uint8 [3, H, W]: the geometry of `eval_transform(resize_mode)` (`train`: of
        `train_transform()`) without the float conversion and normalisation, which the model applies to uint8 input
        itself. What the loader's workers and the evaluation compute (pixels.py: the same pixels within one grey
        level, four times fewer bytes, several times faster)."""
        cfg = self.preprocess_cfg
        return pixel_transform(tuple(cfg["size"]), resize_mode, cfg["interpolation"], train=train)

    def train_transform(self):
        """open_clip's training preprocess, `image_transform(is_train=True)` = open_clip_train's `preprocess_train`
        (FSC-CLIP's and DeGLA's): RandomResizedCrop(scale (0.9, 1.0), bicubic), then the model's mean/std. Random:
        for images only, never with boxes (their coordinates follow `transform`'s squash resize)."""
        cfg = self.preprocess_cfg
        return open_clip.image_transform(tuple(cfg["size"]), is_train=True, mean=tuple(cfg["mean"]),
                                         std=tuple(cfg["std"]))

    # ---- geometry and tokenizer -------------------------------------------------------------------
    @property
    def vision(self):
        """The image tower's contract (`towers.OpenClipViT` / `towers.TimmViT`)."""
        return vision_tower(self.clip.visual)

    @property
    def text_tower(self) -> nn.Module:
        return text_tower(self.clip)

    @property
    def image_size(self) -> int:
        height, width = self.vision.image_size
        return height if height == width else (height, width)

    @property
    def patch_size(self) -> int:
        height, width = self.vision.patch_size
        return height if height == width else (height, width)

    @property
    def grid(self) -> tuple[int, int]:
        return self.vision.grid

    @property
    def num_vision_blocks(self) -> int:
        return len(self.vision.blocks)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def context_length(self) -> int:
        return self.text_tower.context_length

    @property
    def embed_dim(self) -> int:
        return int(self.model_cfg["embed_dim"])

    @property
    def tokenizer(self):
        """open_clip's tokenizer at the model's current context length (picklable, for loader workers)."""
        return get_tokenizer(self.tokenizer_source, self.context_length)

    def tokenize(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        return get_tokenizer(self.tokenizer_source, context_length or self.context_length)(texts)

    def token_span(self, text: str, char_start: int, char_end: int) -> list[int]:
        return token_span(self.tokenizer, text, char_start, char_end)

    def box_patch_mask(self, boxes: torch.Tensor) -> torch.Tensor:
        return regions.box_patch_mask(boxes, self.vision.image_size, self.vision.patch_size)

    # ---- global embeddings -------------------------------------------------------------------------
    def encode_image(self, image: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        if self._reused is not None and normalize:
            return self.image_features(image)["global_"]
        return self.clip.encode_image(self.image_input(image), normalize=normalize)

    def image_input(self, image: torch.Tensor) -> torch.Tensor:
        """The tower's input: uint8 pixels normalised with the model's mean/std (float32), then the input dtype."""
        if image.dtype == torch.uint8:
            image = normalize_pixels(image, self.pixel_mean, self.pixel_std)
        return image.to(self.input_dtype)

    def encode_text(self, text: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        if self._reused is not None and normalize:
            return self.text_features(text)["global_"]
        text, hidden = self._text_trunk(text, trim=True)
        pooled = self.text_tower.ln_final(hidden[torch.arange(len(text), device=text.device),
                                                 self._eot_positions(text)])
        pooled = self._project_text(pooled)
        return F.normalize(pooled, dim=-1) if normalize else pooled

    def forward(self, image: torch.Tensor | None = None, text: torch.Tensor | None = None) -> dict:
        return {"image_features": self.encode_image(image) if image is not None else None,
                "text_features": self.encode_text(text) if text is not None else None,
                "logit_scale": self.clip.logit_scale.exp()}

    # ---- token-level features ----------------------------------------------------------------------
    def image_features(self, image: torch.Tensor, dense: bool = False) -> dict[str, torch.Tensor]:
        """One forward: global_ [B,D] normalised (global_raw: before the L2), patches [B,P,D] projected, hidden
        [B,P,W] pre-ln_post.

        `dense=True` adds `dense` [B,D,gh,gw] (MaskCLIP) from the same trunk (blocks 0..L-2 shared).
        """
        if self._reused is not None:
            hit = self._reused.get(("image", id(image), True)) or self._reused.get(("image", id(image), dense))
            return (hit or self._reuse(("image", id(image), dense), image,
                                       lambda: self._image_features(image, dense)))[1]
        return self._image_features(image, dense)

    def _image_features(self, image: torch.Tensor, dense: bool) -> dict[str, torch.Tensor]:
        visual = self.clip.visual
        last = self.num_vision_blocks - 1
        out = visual.forward_intermediates(self.image_input(image), indices=[last - 1, last] if dense else [last],
                                           output_fmt="NLC", output_extra_tokens=dense)
        hidden = out["image_intermediates"][-1]
        features = {"global_": F.normalize(out["image_features"], dim=-1), "global_raw": out["image_features"],
                    "patches": self.vision.head(hidden),
                    "hidden": hidden}
        if dense:
            features["dense"] = self._dense_head(out["image_intermediates_prefix"][0], out["image_intermediates"][0])
        return features

    def text_features(self, text: torch.Tensor, trim: bool = True,
                      detach_token_projection: bool = False) -> dict[str, torch.Tensor]:
        """global_ [B,D] normalised, tokens [B,L,D] projected, mask [B,L], hidden [B,L,W] pre-ln_final.

        L is the batch's longest sequence when `trim` (exact under the causal mask), else the context.
        `detach_token_projection`: `tokens` go through a detached copy of the text projection (same values, no
        gradient from them into the projection; `global_` keeps the live one) -- HarmoCLIP's eqs. (3)-(4).
        """
        if self._reused is not None:           # a detached token projection is another graph: its own entry
            key = ("text", id(text), trim, detach_token_projection)
            hit = self._reused.get(key) or self._reuse(key, text, lambda: self._text_features(text, trim,
                                                                                               detach_token_projection))
            return hit[1]
        return self._text_features(text, trim, detach_token_projection)

    def _text_features(self, text: torch.Tensor, trim: bool, detach_token_projection: bool) -> dict[str, torch.Tensor]:
        text, hidden = self._text_trunk(text, trim=trim)
        normed = self.text_tower.ln_final(hidden)
        tokens = self._project_text(normed)
        eot = self._eot_positions(text)
        mask = text != PAD_ID
        mask[:, 0] = False
        global_ = F.normalize(tokens[torch.arange(len(text), device=text.device), eot], dim=-1)
        if detach_token_projection:
            tokens = self._project_text(normed, detach=True)
        return {"global_": global_, "tokens": tokens, "mask": mask, "hidden": hidden}

    def pool_image_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B,W] pooled pre-ln_post tokens -> ln_post, projection, L2 (GOAL's TSL image side)."""
        return F.normalize(self.vision.head(hidden), dim=-1)

    def pool_text_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B,W] pooled pre-ln_final states -> ln_final, projection, L2 (GOAL's TSL text side)."""
        return F.normalize(self._project_text(self.text_tower.ln_final(hidden)), dim=-1)

    # ---- dense / region features ------------------------------------------------------------------
    def dense_features(self, image: torch.Tensor) -> torch.Tensor:
        """[B, D, gh, gw] L2-normalised MaskCLIP features (last block without attention mixing)."""
        last = self.num_vision_blocks - 1
        out = self.clip.visual.forward_intermediates(
            self.image_input(image), indices=[last - 1], stop_early=True, intermediates_only=True,
            output_fmt="NLC", output_extra_tokens=True)
        return self._dense_head(out["image_intermediates_prefix"][0], out["image_intermediates"][0])

    def pool_regions(self, dense: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
        """RoIAlign 1x1 over a dense map for xyxy boxes in input pixels -> [sum n_i, D] normalised."""
        return F.normalize(regions.roi_pool(dense, boxes, self.vision.image_size), dim=-1)

    def region_features(self, image: torch.Tensor, boxes: list[torch.Tensor]) -> torch.Tensor:
        return self.pool_regions(self.dense_features(image), boxes)

    # ---- one forward per input for several callers ---------------------------------------------------
    @contextlib.contextmanager
    def reusing_features(self):
        """Inside the block, `image_features` / `text_features` on an input tensor object already seen return the
        first call's result (the `custom` mix: several methods' features modules over this one model and batch).
        `encode_image(x)` / `encode_text(t)` (normalised) are then served as `*_features(x)["global_"]`, the same
        computation bit for bit, and a `dense=False` image request reuses a `dense=True` result."""
        self._reused = {}
        try:
            yield
        finally:
            self._reused = None

    def _reuse(self, key: tuple, inputs: torch.Tensor, compute) -> tuple:
        self._reused[key] = (inputs, compute())             # the input is kept: its id stays its own in the block
        return self._reused[key]

    # ---- export support ---------------------------------------------------------------------------
    def export_config(self) -> dict:
        """The open_clip `model_cfg` that rebuilds this model (context length and activation included)."""
        cfg = copy.deepcopy(self.model_cfg)
        cfg["text_cfg"]["context_length"] = self.context_length
        cfg["quick_gelu"] = any(isinstance(m, QuickGELU) for m in self.clip.modules())
        return cfg

    # ---- internals ---------------------------------------------------------------------------------
    def _dense_head(self, prefix_tokens: torch.Tensor, patch_tokens: torch.Tensor) -> torch.Tensor:
        vision = self.vision
        x = vision.value_path_block(vision.blocks[-1], torch.cat([prefix_tokens, patch_tokens], dim=1))
        x = F.normalize(vision.head(x[:, prefix_tokens.shape[1]:]), dim=-1)
        return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], *self.grid)

    def _can_trim(self) -> bool:
        return self.text_tower.attn_mask is not None and text_pool(self.clip)[0] in ("argmax", "eos")

    def _eot_positions(self, text: torch.Tensor) -> torch.Tensor:
        pool_type, eos_id = text_pool(self.clip)
        if pool_type == "eos":
            return (text == eos_id).int().argmax(dim=-1)
        if pool_type == "argmax":     # EOT is the largest id in CLIP's vocabulary
            return text.argmax(dim=-1)
        raise NotImplementedError(f"text pool type {pool_type!r} has no EOT position")

    def _text_trunk(self, text: torch.Tensor, trim: bool) -> tuple[torch.Tensor, torch.Tensor]:
        clip = self.text_tower
        if text.shape[1] != clip.context_length:
            raise ValueError(f"text is tokenized to {text.shape[1]} positions, the model takes {clip.context_length}")
        # not under torch.compile: there the full context keeps one static graph (no graph break, no recompile)
        trim = trim and self._can_trim() and not torch.compiler.is_compiling()
        # sync: the trimmed length is the batch's longest text, a shape that depends on the data
        length = int(self._eot_positions(text).max()) + 1 if trim else text.shape[1]
        text = text[:, :length]
        cast_dtype = clip.transformer.get_cast_dtype()
        x = clip.token_embedding(text).to(cast_dtype) + clip.positional_embedding[:length].to(cast_dtype)
        attn_mask = clip.attn_mask[:length, :length] if clip.attn_mask is not None else None
        return text, clip.transformer(x, attn_mask=attn_mask)

    def _project_text(self, x: torch.Tensor, detach: bool = False) -> torch.Tensor:
        projection = self.text_tower.text_projection
        if projection is None:
            return x
        if isinstance(projection, nn.Linear):
            if not detach:
                return projection(x)
            bias = projection.bias.detach() if projection.bias is not None else None
            return F.linear(x, projection.weight.detach(), bias)
        return x @ (projection.detach() if detach else projection)


def _check_supported(clip: nn.Module) -> None:
    if not isinstance(clip, (open_clip.CLIP, open_clip.CustomTextCLIP)) or (
            isinstance(clip, open_clip.CustomTextCLIP) and text_tower(clip) is clip):
        raise NotImplementedError("ClipModel wraps open_clip's CLIP/CustomTextCLIP with open_clip's text transformer "
                                  "(not HF text towers)")
    reason = vision_tower(clip.visual).unsupported()      # ResNet towers: NotImplementedError from vision_tower
    if reason:
        raise NotImplementedError(reason)
