"""Long-CLIP "knowledge-preserved stretching" of the text positional embedding (77 -> 248).

Following Long-CLIP (`model/longclip.py` load_from_clip, docs/methods.md §0.1): rows 0..keep-1 are copied,
rows keep+r*i+j = (1 - j/r) P[keep+i] + (j/r) P[keep+i+1], and the last r rows extrapolate linearly past
P[n-1]. `length = keep + r * (n - keep)`; 248 for n = 77, keep = 20, r = 4.

Decisions:
- `freeze_kept=True` is Long-CLIP's split (frozen table for rows < keep, trainable residual for the rest),
  written as a `torch.nn.utils.parametrize` parametrization: `clip.positional_embedding` stays a plain
  [length, W] tensor for open_clip's own `encode_text`, the kept rows come from a buffer (immune to
  gradients *and* to decoupled weight decay, which a gradient hook would not stop), and the trainable
  rows live in `parametrizations.positional_embedding.original`. GOAL's port trains all rows:
  `freeze_kept=False` (the default).
- The model's config records the new context length, so an export loads in plain open_clip. Exports
  fold the table through the state dict (`fold_kept_rows_state_dict`), never `remove_parametrizations`:
  deep copies (teachers) share the injected class, and removing it from one copy would break the others.
  A parametrized module cannot be pickled whole (torch's rule); save its `state_dict()`.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .towers import text_tower

LONG_CONTEXT = 248        # Long-CLIP's stretched context, 20 + 4 * (77 - 20): GOAL and MulCLIP train and tokenize at it
KEEP_ROWS = 20            # Long-CLIP's kept rows (the first 20 positions, the ones short captions mostly use)


def stretch_positional_embedding(table: torch.Tensor, keep: int = 20, ratio: int = 4) -> torch.Tensor:
    """Long-CLIP's stretched copy of an [n, W] table -> [keep + ratio * (n - keep), W]."""
    n = table.shape[0]
    if not 0 < keep < n - 1 or ratio < 1:
        raise ValueError(f"cannot stretch {n} positions keeping {keep} by {ratio}")
    step = torch.arange(ratio, dtype=table.dtype, device=table.device) / ratio           # j / r
    lower, upper = table[keep:n - 1], table[keep + 1:n]
    interpolated = lower[:, None] * (1 - step)[None, :, None] + upper[:, None] * step[None, :, None]
    extrapolated = table[n - 1] + step[:, None] * (table[n - 1] - table[n - 2])
    return torch.cat([table[:keep], interpolated.reshape(-1, table.shape[1]), extrapolated])


class KeptRows(nn.Module):
    """Parametrization: rows [0, keep) come from a frozen buffer, the rest from the trainable tensor."""

    def __init__(self, kept_rows: torch.Tensor):
        super().__init__()
        self.register_buffer("kept_rows", kept_rows.detach().clone())

    def forward(self, trainable: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.kept_rows.to(trainable.dtype), trainable[self.kept_rows.shape[0]:]])


def causal_mask(length: int, device=None) -> torch.Tensor:
    """open_clip's additive causal mask (TextTransformer.build_causal_mask) at `length`."""
    return torch.full((length, length), float("-inf"), device=device).triu_(1)


def extend_context(model: nn.Module, length: int = LONG_CONTEXT, keep: int = KEEP_ROWS, freeze_kept: bool = False,
                   ratio: int | None = None) -> nn.Module:
    """Stretch a CLIP's text positions in place (Long-CLIP); `ratio` overrides `length`."""
    owner = getattr(model, "clip", model)
    clip = text_tower(owner)                 # the module holding the text positions (CustomTextCLIP: `clip.text`)
    if parametrize.is_parametrized(clip, "positional_embedding"):
        raise ValueError("the text positional embedding is already stretched")
    old = clip.positional_embedding.detach()
    n = old.shape[0]
    if ratio is None:
        ratio, remainder = divmod(length - keep, n - keep)
        if remainder or ratio < 1:
            raise ValueError(f"length {length} is not keep + ratio * ({n} - keep) for keep {keep}")
    new_table = stretch_positional_embedding(old.float(), keep, ratio).to(old.dtype)
    length = new_table.shape[0]

    clip.positional_embedding = nn.Parameter(new_table, requires_grad=clip.positional_embedding.requires_grad)
    if freeze_kept:
        parametrize.register_parametrization(clip, "positional_embedding", KeptRows(new_table[:keep]))
    clip.context_length = owner.context_length = length
    clip.attn_mask = causal_mask(length, device=old.device)      # non-persistent buffer, as open_clip's
    return model


def stretch_to_long(model: nn.Module, freeze_kept: bool) -> None:
    """Stretch the text positions to LONG_CONTEXT (Long-CLIP) unless the model already takes that many tokens (e.g.
    a Long-CLIP base). GOAL's port trains every row (`freeze_kept=False`); MulCLIP keeps Long-CLIP's frozen rows."""
    if model.context_length == LONG_CONTEXT:
        return
    extend_context(model, LONG_CONTEXT, keep=KEEP_ROWS, freeze_kept=freeze_kept)


def fold_kept_rows_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `freeze_kept` checkpoint's state dict as a plain model's (`positional_embedding` key)."""
    folded = dict(state_dict)
    for original_key in [k for k in state_dict if k.endswith("parametrizations.positional_embedding.original")]:
        prefix = original_key[:-len("parametrizations.positional_embedding.original")]    # "text." (CustomTextCLIP)
        kept = folded.pop(prefix + "parametrizations.positional_embedding.0.kept_rows")
        table = folded.pop(original_key).clone()
        table[:kept.shape[0]] = kept
        folded[prefix + "positional_embedding"] = table
    return folded
