"""Model layer on open_clip: token/patch/dense region features, long text, LoRA, teachers, export.

See DEVELOPERS.md "Model layer" for the contract; each submodule's docstring says what it decides.
"""
from .clip_model import ClipModel
from .loading import (
    export_model,
    load_model,
    load_state_dict_into,
    quick_gelu_setting,
    read_state_dict,
    register_bundled_configs,
)
from .long_text import LONG_CONTEXT, extend_context, stretch_positional_embedding, stretch_to_long
from .lora import apply_lora, has_lora, merge_lora
from .teachers import ema_teacher, ema_update, freeze_tower, freeze_vision_blocks, frozen_teacher
from .text import get_tokenizer, token_span

register_bundled_configs()

__all__ = [
    "LONG_CONTEXT",
    "ClipModel",
    "apply_lora",
    "ema_teacher",
    "ema_update",
    "export_model",
    "extend_context",
    "freeze_tower",
    "freeze_vision_blocks",
    "frozen_teacher",
    "get_tokenizer",
    "has_lora",
    "load_model",
    "load_state_dict_into",
    "merge_lora",
    "quick_gelu_setting",
    "read_state_dict",
    "register_bundled_configs",
    "stretch_positional_embedding",
    "stretch_to_long",
    "token_span",
]
