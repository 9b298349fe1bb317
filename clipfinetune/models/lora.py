"""LoRA on open_clip's transformers: attention projections, MLP linears and (FSC-CLIP) the patch embed.

open_clip's attention is `nn.MultiheadAttention`, whose packed `in_proj_weight` is not an `nn.Linear`
and whose `out_proj` is read as raw weights (never called), so `peft`-style Linear wrapping cannot reach
it. We subclass the three torch modules instead; a LoRA module keeps the base module's parameter names
(`in_proj_weight`, `out_proj.weight`, `c_fc.weight`, ...) plus `lora_A`, `lora_B` and a persistent
`lora_scaling` buffer, so checkpoints are self-describing and `merge_lora` gives back plain modules.

Decisions (docs/methods.md §2.4, §6.4):
- `init="zero"`: every LoRA starts with A ~ Kaiming-uniform, B = 0, so the model is unchanged; alpha
  defaults to the rank (scaling 1).
- `init="fsc_clip"`: FSC-CLIP's `lora_layers.py`: alpha defaults to 1 (scaling 1/r); LoRA also on the
  patch-embed Conv2d (loralib layout A [r*k, in*k], B [out*k, r*k]); the packed q/k/v LoRA (one A
  [r, W] shared by q, k, v, B [3W, r]) starts with *both* A and B xavier-uniform, so the model starts
  slightly perturbed; out_proj and MLP LoRA start at zero.
- timm image towers (EVA02-CLIP): LoRA on every `nn.Linear` of each block (EVA's separate q/k/v projections,
  attention out-projection, SwiGLU MLP), B = 0 at the start whatever `init`; the patch-embed conv as above.
- Dropout acts on the LoRA input of linears and attention; the conv LoRA merges on the fly (as loralib)
  and ignores dropout. By default only LoRA parameters stay trainable (FSC-CLIP's
  `mark_only_lora_as_trainable`, which also freezes `logit_scale`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .towers import OpenClipViT, text_tower, vision_tower

LORA_INITS = ("zero", "fsc_clip")


class _LoRAMixin:
    def _add_lora(self, base_weight: torch.Tensor, a_shape, b_shape, rank: int, alpha: float, dropout: float) -> None:
        like = {"dtype": base_weight.dtype, "device": base_weight.device}
        self.lora_A = nn.Parameter(torch.empty(a_shape, **like))
        self.lora_B = nn.Parameter(torch.zeros(b_shape, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.register_buffer("lora_scaling", torch.tensor(float(alpha) / rank))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def _low_rank(self, x: torch.Tensor, b_rows: slice = slice(None)) -> torch.Tensor:
        return F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B[b_rows]) * self.lora_scaling


class LoRALinear(NonDynamicallyQuantizableLinear, _LoRAMixin):
    """y = W x + b + (alpha/r) B A dropout(x)."""

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, alpha: float, dropout: float) -> LoRALinear:
        module = cls(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        module.weight, module.bias = base.weight, base.bias
        module._add_lora(base.weight, (rank, base.in_features), (base.out_features, rank), rank, alpha, dropout)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self._low_rank(x)

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.weight.add_(self.lora_B @ self.lora_A * self.lora_scaling)
        plain = NonDynamicallyQuantizableLinear(self.in_features, self.out_features, bias=self.bias is not None,
                                                device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        return plain


class LoRAConv2d(nn.Conv2d, _LoRAMixin):
    """Conv with weight W + (alpha/r) (B A).view(W.shape), loralib's layout (square kernels)."""

    @classmethod
    def wrap(cls, base: nn.Conv2d, rank: int, alpha: float, dropout: float) -> LoRAConv2d:
        kernel = base.kernel_size[0]
        if base.kernel_size[0] != base.kernel_size[1] or base.groups != 1:
            raise NotImplementedError("conv LoRA needs a square kernel and groups=1")
        module = cls(base.in_channels, base.out_channels, base.kernel_size, stride=base.stride,
                     padding=base.padding, dilation=base.dilation, bias=base.bias is not None, device="meta")
        module.weight, module.bias = base.weight, base.bias
        module._add_lora(base.weight, (rank * kernel, base.in_channels * kernel),
                         (base.out_channels * kernel, rank * kernel),
                         rank, alpha, dropout)
        return module

    def _delta(self) -> torch.Tensor:
        return (self.lora_B @ self.lora_A).view(self.weight.shape) * self.lora_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.weight + self._delta(), self.bias)

    def merged(self) -> nn.Conv2d:
        with torch.no_grad():
            self.weight.add_(self._delta())
        plain = nn.Conv2d(self.in_channels, self.out_channels, self.kernel_size, stride=self.stride,
                          padding=self.padding, dilation=self.dilation, bias=self.bias is not None, device="meta")
        plain.weight, plain.bias = self.weight, self.bias
        return plain


class LoRAMultiheadAttention(nn.MultiheadAttention, _LoRAMixin):
    """Self-attention with LoRA on the packed q/k/v projection and on out_proj.

    Runs `F.scaled_dot_product_attention`; only what open_clip's blocks use is supported (self-attention,
    an additive or boolean `attn_mask`, no key padding mask, no attention weights).
    """

    @classmethod
    def wrap(cls, base: nn.MultiheadAttention, rank: int, alpha: float, dropout: float,
             init: str) -> LoRAMultiheadAttention:
        if not base._qkv_same_embed_dim or base.bias_k is not None or base.add_zero_attn:
            raise NotImplementedError("LoRA attention supports open_clip's packed self-attention only")
        module = cls(base.embed_dim, base.num_heads, dropout=base.dropout, bias=base.in_proj_bias is not None,
                     batch_first=base.batch_first, device="meta")
        module.in_proj_weight, module.in_proj_bias = base.in_proj_weight, base.in_proj_bias
        module.out_proj = LoRALinear.wrap(base.out_proj, rank, alpha, dropout)
        module._add_lora(base.in_proj_weight, (rank, base.embed_dim), (3 * base.embed_dim, rank), rank, alpha, dropout)
        if init == "fsc_clip":      # FSC-CLIP lora_layers.py MultiheadAttention._reset_parameters
            nn.init.xavier_uniform_(module.lora_A)
            nn.init.xavier_uniform_(module.lora_B)
        return module

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=False, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise NotImplementedError("LoRA attention is self-attention only")
        if key_padding_mask is not None or need_weights:
            raise NotImplementedError("LoRA attention supports neither key_padding_mask nor need_weights")
        x = query if self.batch_first else query.transpose(0, 1)
        batch, length, width = x.shape
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias) + self._low_rank(x)
        q, k, v = qkv.view(batch, length, 3, self.num_heads, width // self.num_heads).permute(2, 0, 3, 1, 4)
        if attn_mask is not None and attn_mask.dtype == torch.bool:   # MHA: True = masked; SDPA: True = kept
            attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill_(attn_mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal and attn_mask is None,
                                             dropout_p=self.dropout if self.training else 0.0)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, width))
        return (out if self.batch_first else out.transpose(0, 1)), None

    def value_path(self, x: torch.Tensor) -> torch.Tensor:
        """out_proj(v_proj(x)) with LoRA, for MaskCLIP's attention-free last block."""
        width = self.embed_dim
        bias = self.in_proj_bias[2 * width:] if self.in_proj_bias is not None else None
        v = F.linear(x, self.in_proj_weight[2 * width:], bias) + self._low_rank(x, slice(2 * width, None))
        return self.out_proj(v)

    def merged(self) -> nn.MultiheadAttention:
        with torch.no_grad():
            self.in_proj_weight.add_(self.lora_B @ self.lora_A * self.lora_scaling)
        plain = nn.MultiheadAttention(self.embed_dim, self.num_heads, dropout=self.dropout,
                                      bias=self.in_proj_bias is not None, batch_first=self.batch_first, device="meta")
        plain.in_proj_weight, plain.in_proj_bias = self.in_proj_weight, self.in_proj_bias
        plain.out_proj = self.out_proj.merged()
        return plain


def apply_lora(model: nn.Module, rank: int = 4, alpha: float | None = None, dropout: float = 0.0,
               init: str = "zero", train_only_lora: bool = True) -> nn.Module:
    """Put LoRA on every transformer block of both towers (in place); returns `model`."""
    if init not in LORA_INITS:
        raise ValueError(f"LoRA init must be one of {LORA_INITS}, got {init!r}")
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if alpha is None:
        alpha = 1.0 if init == "fsc_clip" else float(rank)
    clip = getattr(model, "clip", model)
    if any(isinstance(m, _LoRAMixin) for m in clip.modules()):
        raise ValueError("model already carries LoRA")
    vision = vision_tower(clip.visual)
    open_clip_blocks = list(text_tower(clip).transformer.resblocks)
    if isinstance(vision, OpenClipViT):
        open_clip_blocks += list(vision.blocks)
    else:
        for block in vision.blocks:
            _lora_on_linears(block, rank, alpha, dropout)
    for block in open_clip_blocks:
        block.attn = LoRAMultiheadAttention.wrap(block.attn, rank, alpha, dropout, init)
        block.mlp.c_fc = LoRALinear.wrap(block.mlp.c_fc, rank, alpha, dropout)
        block.mlp.c_proj = LoRALinear.wrap(block.mlp.c_proj, rank, alpha, dropout)
    if init == "fsc_clip":
        vision.patch_embed = LoRAConv2d.wrap(vision.patch_embed, rank, alpha, dropout)
    if train_only_lora:
        for name, param in clip.named_parameters():
            param.requires_grad_(name.rsplit(".", 1)[-1] in ("lora_A", "lora_B"))
    return model


def _lora_on_linears(block: nn.Module, rank: int, alpha: float, dropout: float) -> None:
    """LoRA on every `nn.Linear` of a timm block (they are all called as modules, so LoRA reaches the output)."""
    attn = getattr(block, "attn", None)
    if getattr(attn, "qkv", None) is not None and getattr(attn, "q_bias", None) is not None:
        raise NotImplementedError("LoRA on a fused qkv with separate biases: timm calls F.linear on its weight")
    for name, module in list(block.named_modules()):
        if isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            setattr(block.get_submodule(parent_name) if parent_name else block, child,
                    LoRALinear.wrap(module, rank, alpha, dropout))


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA into its base weights (in place) and restore plain torch modules."""
    clip = getattr(model, "clip", model)
    for kind in (LoRAMultiheadAttention, (LoRALinear, LoRAConv2d)):   # attention first: it merges its out_proj
        for name, module in list(clip.named_modules()):
            if isinstance(module, kind):
                parent_name, _, child = name.rpartition(".")
                setattr(clip.get_submodule(parent_name) if parent_name else clip, child, module.merged())
    return model


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, _LoRAMixin) for m in model.modules())


def fold_lora_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's state dict as the merged plain model's (uses the stored `lora_scaling`)."""
    folded = dict(state_dict)
    for key in [k for k in state_dict if k.endswith(".lora_A")]:
        prefix = key[: -len("lora_A")]
        target = prefix + ("in_proj_weight" if prefix + "in_proj_weight" in state_dict else "weight")
        weight = state_dict[target]
        delta = (state_dict[prefix + "lora_B"].float() @ state_dict[key].float()) * state_dict[prefix + "lora_scaling"]
        folded[target] = (weight.float() + delta.view(weight.shape)).to(weight.dtype)
        for suffix in ("lora_A", "lora_B", "lora_scaling"):
            folded.pop(prefix + suffix)
    return folded
