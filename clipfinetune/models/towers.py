"""One contract over the towers `ClipModel` accepts: open_clip's own ViT, and open_clip's timm tower (EVA02-CLIP).

Image towers (`vision_tower(clip.visual)`):
- `OpenClipViT`: open_clip's `VisionTransformer` (ViT-B-32, B-16, L-14, ...): blocks `transformer.resblocks`, stem
  conv1 / class and positional embeddings / ln_pre, head `ln_post` then `proj`, one CLS prefix token.
- `TimmViT`: open_clip's `TimmModel` around a timm ViT-family trunk with CLS pooling (`EVA02-B-16`,
  `eva02_base_patch16_clip_224`): blocks `trunk.blocks`, stem = the parameters timm's own `group_matcher()` calls
  "stem" (patch embed, cls token, pos embed, norm_pre), head = `trunk.norm` -> `fc_norm` -> `trunk.head` (EVA-CLIP's
  projection is timm's classifier head) -> `TimmModel.head`, prefix tokens `trunk.num_prefix_tokens`. Patch
  tokens and the MaskCLIP input come from `TimmModel.forward_intermediates`, the same call as open_clip's ViT.
Both give `head(tokens)` per token (the pooled embedding is `head` of the CLS token: LayerNorm acts per token) and
`value_path_block(block, x)`: the block with its attention mixing removed (MaskCLIP; EVA's rotary embedding acts
on q and k only, so the value path has no position term, and its sub-LN `attn.norm` is kept).

Text towers: `CLIP` holds its text transformer's modules itself; `CustomTextCLIP` (the EVA02 configs,
`custom_text: true`) holds an open_clip `TextTransformer` as `clip.text`, with the same module names
(`token_embedding`, `positional_embedding`, `transformer`, `ln_final`, `text_projection`, `attn_mask`).
`text_tower(clip)` is the module that holds them.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from open_clip.timm_model import TimmModel
from open_clip.transformer import PatchDropout, ResidualAttentionBlock, TextTransformer, VisionTransformer
from torch import nn

from . import regions

TIMM_BLOCKS = ("EvaBlock", "Block")                 # timm's pre-norm ViT blocks (eva.py, vision_transformer.py)


def text_tower(clip: nn.Module) -> nn.Module:
    """The module holding the text transformer's parts: `clip.text` (CustomTextCLIP) or `clip` itself (CLIP)."""
    text = getattr(clip, "text", None)
    return text if isinstance(text, TextTransformer) else clip


def text_pool(clip: nn.Module) -> tuple[str, int | None]:
    """(pool type, EOS id) of the text tower: open_clip names them `text_pool_type`/`text_eos_id` on a CLIP."""
    tower = text_tower(clip)
    if tower is clip:
        return clip.text_pool_type, getattr(clip, "text_eos_id", None)
    return tower.pool_type, tower.eos_id


class OpenClipViT:
    def __init__(self, visual: VisionTransformer):
        self.visual = visual

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.visual.image_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        return tuple(self.visual.patch_size)

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.visual.grid_size)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.visual.transformer.resblocks

    num_prefix_tokens = 1

    @property
    def patch_embed(self) -> nn.Conv2d:
        return self.visual.conv1

    @patch_embed.setter
    def patch_embed(self, conv: nn.Conv2d) -> None:
        self.visual.conv1 = conv

    def stem_parameters(self) -> list[nn.Parameter]:
        v = self.visual
        return [*v.conv1.parameters(), *v.ln_pre.parameters(), v.class_embedding, v.positional_embedding]

    def head(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.visual.ln_post(tokens) @ self.visual.proj

    def value_path_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(block, ResidualAttentionBlock):
            raise NotImplementedError("dense features need open_clip's ResidualAttentionBlock, "
                                      f"got {type(block).__name__}")
        return regions.value_path_block(block, x)

    def unsupported(self) -> str | None:
        v = self.visual
        if v.attn_pool is not None or v.pool_type != "tok" or v.final_ln_after_pool:
            return "ClipModel needs CLS-token pooling with ln_post before pooling (CLIP ViTs)"
        if isinstance(v.patch_dropout, PatchDropout):
            return "patch dropout changes the patch grid that patch/box features index"
        return None


class TimmViT:
    def __init__(self, visual: TimmModel):
        self.visual, self.trunk = visual, visual.trunk

    @property
    def image_size(self) -> tuple[int, int]:
        return tuple(self.visual.image_size)

    @property
    def patch_size(self) -> tuple[int, int]:
        return tuple(self.trunk.patch_embed.patch_size)

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.trunk.patch_embed.grid_size)

    @property
    def blocks(self) -> nn.Sequential:
        return self.trunk.blocks

    @property
    def num_prefix_tokens(self) -> int:
        return self.trunk.num_prefix_tokens

    @property
    def patch_embed(self) -> nn.Conv2d:
        return self.trunk.patch_embed.proj

    @patch_embed.setter
    def patch_embed(self, conv: nn.Conv2d) -> None:
        self.trunk.patch_embed.proj = conv

    def stem_parameters(self) -> list[nn.Parameter]:
        stem = self.trunk.group_matcher()["stem"]
        return [p for name, p in self.trunk.named_parameters() if re.match(stem, name)]

    def head(self, tokens: torch.Tensor) -> torch.Tensor:
        trunk = self.trunk
        return self.visual.head(trunk.head(trunk.head_drop(trunk.fc_norm(trunk.norm(tokens)))))

    def value_path_block(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = x + _layer_scale(block, 1, _attention_value_path(block.attn, block.norm1(x)))
        return x + _layer_scale(block, 2, block.mlp(block.norm2(x)))

    def unsupported(self) -> str | None:
        trunk = self.trunk
        needs = ("blocks", "patch_embed", "num_prefix_tokens", "forward_intermediates", "group_matcher")
        if not all(hasattr(trunk, n) for n in needs):
            return f"timm trunk {type(trunk).__name__} is not a ViT (needs {', '.join(needs)})"
        if getattr(trunk, "global_pool", None) != "token" or trunk.num_prefix_tokens < 1 or len(self.visual.head):
            return "ClipModel needs CLS-token pooling (timm global_pool 'token', no open_clip pool/projection head)"
        if getattr(trunk, "dynamic_img_size", False):
            return "a dynamic image size changes the patch grid that patch/box features index"
        if getattr(trunk, "patch_drop", None) is not None and not isinstance(trunk.patch_drop, nn.Identity):
            return "patch dropout changes the patch grid that patch/box features index"
        kinds = {type(b).__name__ for b in trunk.blocks}
        if not kinds <= set(TIMM_BLOCKS):
            return f"timm blocks {sorted(kinds)}: dense features support the pre-norm {', '.join(TIMM_BLOCKS)}"
        return None


def vision_tower(visual: nn.Module) -> OpenClipViT | TimmViT:
    if isinstance(visual, VisionTransformer):
        return OpenClipViT(visual)
    if isinstance(visual, TimmModel):
        return TimmViT(visual)
    raise NotImplementedError(f"ClipModel wraps open_clip's ViT or timm ViT image towers, not {type(visual).__name__}")


def _layer_scale(block: nn.Module, which: int, y: torch.Tensor) -> torch.Tensor:
    gamma = getattr(block, f"gamma_{which}", None)             # EvaBlock's layer scale (None: off)
    if gamma is not None:
        return gamma * y
    return getattr(block, f"ls{which}", nn.Identity())(y)     # timm Block's LayerScale (Identity: off)


def _attention_value_path(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """proj(norm(v_proj(x))) of a timm attention (every query attending to itself; rope touches q, k only)."""
    if getattr(attn, "gate", None) is not None:
        raise NotImplementedError("dense features do not support gated timm attention")
    if getattr(attn, "v_proj", None) is not None:                # EVA, unfused q/k/v
        v = attn.v_proj(x)
    elif getattr(attn, "q_bias", None) is not None:              # EVA fused qkv, biases kept apart
        width = x.shape[-1]
        v = F.linear(x, attn.qkv.weight[2 * width:], attn.v_bias)
    else:                                                        # timm ViT: packed qkv (LoRA, if any, included)
        v = attn.qkv(x)[..., 2 * x.shape[-1]:]
    return attn.proj(getattr(attn, "norm", nn.Identity())(v))
