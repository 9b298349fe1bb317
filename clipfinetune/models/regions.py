"""Region-level features: MaskCLIP's attention-free last block, RoIAlign over boxes, box -> patches.

Decisions the papers leave open:
- Dense features follow FineCLIP/CLIPSelf (docs/methods.md §1.2): blocks 0..L-2 run normally, the last block
  keeps only the value path of its attention (`out_proj(v_proj(ln_1(x)))`, v bias kept, no q/k, no
  softmax) and its MLP; CLS dropped; `ln_post`, projection, and every location L2-normalised.
- Boxes are given in *input pixels* (after `boxes.resize_boxes`), mapped to grid units by the model's own
  patch size, and pooled with `torchvision.ops.roi_align(output_size=1, sampling_ratio=-1,
  aligned=True)` exactly as FineCLIP; the pooled vector is re-normalised.
- `box_patch_mask` uses GOAL's rule (every touched patch: floor for the start, ceil for the end,
  clamped to the grid); a degenerate (zero-width/height) box still covers the patch it lies in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import roi_align


def attention_value_path(attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`out_proj(v_proj(x))` of an attention module: attention with every query attending to itself."""
    if hasattr(attn, "value_path"):            # our LoRA attention adds its low-rank terms
        return attn.value_path(x)
    if not isinstance(attn, nn.MultiheadAttention) or not attn._qkv_same_embed_dim:
        raise NotImplementedError(f"dense features need a packed nn.MultiheadAttention, got {type(attn).__name__}")
    width = attn.embed_dim
    bias = attn.in_proj_bias[2 * width:] if attn.in_proj_bias is not None else None
    v = F.linear(x, attn.in_proj_weight[2 * width:], bias)
    return attn.out_proj(v)


def value_path_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An open_clip ResidualAttentionBlock with its attention mixing removed (MaskCLIP)."""
    x = x + block.ls_1(attention_value_path(block.attn, block.ln_1(x)))
    return x + block.ls_2(block.mlp(block.ln_2(x)))


def roi_pool(feature_map: torch.Tensor, boxes: list[torch.Tensor] | torch.Tensor,
             image_size: tuple[int, int]) -> torch.Tensor:
    """RoIAlign 1x1 of xyxy boxes given in input pixels over a [B, C, gh, gw] map -> [sum n_i, C]."""
    grid_h, grid_w = feature_map.shape[-2:]
    img_h, img_w = image_size
    to_grid = feature_map.new_tensor([grid_w / img_w, grid_h / img_h, grid_w / img_w, grid_h / img_h])
    if isinstance(boxes, torch.Tensor):         # [K, 5] with batch index first, as roi_align accepts
        rois = torch.cat([boxes[:, :1].to(feature_map.dtype), boxes[:, 1:].to(feature_map.dtype) * to_grid], 1)
    else:
        rois = [b.to(device=feature_map.device, dtype=feature_map.dtype) * to_grid for b in boxes]
    pooled = roi_align(feature_map, rois, output_size=(1, 1), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    return pooled[:, :, 0, 0]


def box_patch_mask(boxes: torch.Tensor, image_size: tuple[int, int], patch_size: tuple[int, int]) -> torch.Tensor:
    """[B, P] bool: the row-major patches (CLS excluded) that each xyxy pixel box touches (on the boxes' device)."""
    img_h, img_w = image_size
    patch_h, patch_w = patch_size
    grid_h, grid_w = img_h // patch_h, img_w // patch_w
    boxes = boxes.detach().to(torch.float64)
    c0, c1 = _patch_range(boxes[:, 0], boxes[:, 2], patch_w, grid_w)
    r0, r1 = _patch_range(boxes[:, 1], boxes[:, 3], patch_h, grid_h)
    cols = torch.arange(grid_w, device=boxes.device)[None, None, :]
    rows = torch.arange(grid_h, device=boxes.device)[None, :, None]
    inside = ((rows >= r0[:, None, None]) & (rows < r1[:, None, None])
              & (cols >= c0[:, None, None]) & (cols < c1[:, None, None]))
    return inside.reshape(len(boxes), grid_h * grid_w)


def _patch_range(lo: torch.Tensor, hi: torch.Tensor, patch: int, grid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last patch index that [lo, hi] (either order) touches, per box, on the device."""
    lo, hi = torch.minimum(lo, hi), torch.maximum(lo, hi)
    start = torch.floor(lo / patch).clamp(0, grid - 1)
    end = torch.minimum(torch.maximum(torch.ceil(hi / patch), start + 1), torch.full_like(start, grid))
    return start, end
