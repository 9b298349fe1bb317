"""Building a `ClipModel` from configs and weights, reading checkpoints safely, exporting.

Decisions:
- `load_model(name, pretrained)` takes, for `name`: an open_clip config name, a bundled config
  (`configs/*.json`, registered with `open_clip.add_model_config`), `local-dir:<dir>` or a folder holding
  `open_clip_config.json`; for `pretrained`: "" (random init), an open_clip tag, a checkpoint file
  (.safetensors, or a torch file read with `weights_only=True`), or an exported folder (which then
  defines the architecture too).
- A checkpoint file may be a bare state dict or wrap one under `state_dict`/`model`; `module.`/`clip.`
  prefixes are stripped; unmerged LoRA and `freeze_kept` position tables are folded into plain weights;
  a text positional table longer than the config's is kept (the model is built at that context length)
  rather than re-interpolated by open_clip.
- An open_clip tag trained with QuickGELU (e.g. OpenAI's) builds the model with QuickGELU, as open_clip
  documents (`force_quick_gelu`); the export records it, so the exported folder needs no "-quickgelu" name.
- `export_model` writes open_clip's `local-dir` layout (`open_clip_config.json` {model_cfg,
  preprocess_cfg} + `open_clip_model.safetensors`, fp32) from a merged copy: LoRA folded, stretched
  positions as one plain table; preprocess `resize_mode` is "squash", the transform the model trained with.
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import pickle
from pathlib import Path

import open_clip
import torch
from open_clip.model import resize_pos_embed
from safetensors.torch import load_file, save_file

from ..io import InputError, atomic_path
from .clip_model import ClipModel
from .long_text import fold_kept_rows_state_dict
from .lora import fold_lora_state_dict, merge_lora

CONFIG_DIR = Path(__file__).parent / "configs"
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
LOCAL_DIR = "local-dir:"
_WRAPPER_PREFIXES = ("module.", "clip.")


def register_bundled_configs() -> None:
    """Make `configs/*.json` (e.g. `cft-tiny-vit`) known to open_clip by name; idempotent."""
    if not all(p.stem in open_clip.list_models() for p in CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(CONFIG_DIR)


def load_model(name: str, pretrained: str = "", device: str | torch.device = "cpu",
               precision: str = "fp32") -> ClipModel:
    register_bundled_configs()
    exported = _as_local_dir(name) or _as_local_dir(pretrained)
    if exported:
        folder = Path(exported[len(LOCAL_DIR):])
        model_cfg = json.loads((folder / CONFIG_FILE).read_text())["model_cfg"]
        if (folder / WEIGHTS_FILE).is_file():
            _load_safetensors(folder / WEIGHTS_FILE)       # a truncated/corrupt file: a clear error naming it
        clip = open_clip.create_model(exported, precision=precision, device=device)
        return ClipModel(clip, model_cfg, tokenizer_source=_tokenizer_source(exported, model_cfg), precision=precision)

    model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        raise ValueError(f"unknown model {name!r}: not an open_clip/bundled config nor an exported folder")
    if not pretrained:
        clip = open_clip.create_model(name, precision=precision, device=device)
    elif os.path.isfile(pretrained):
        state_dict = read_state_dict(pretrained)
        context_length = _checkpoint_context_length(state_dict, model_cfg)
        model_cfg["text_cfg"]["context_length"] = context_length
        with _quiet_random_init_warning():      # the weights come next, from the file
            clip = open_clip.create_model(name, precision=precision, device=device,
                                          force_context_length=context_length)
        load_state_dict_into(clip, state_dict, pretrained)
    else:
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained)
        if not tag_cfg:
            raise ValueError(f"pretrained {pretrained!r} is neither a file, an exported folder, "
                             f"nor an open_clip tag of {name!r}")
        quick_gelu = bool(tag_cfg.get("quick_gelu", False)) or bool(model_cfg.get("quick_gelu", False))
        model_cfg["quick_gelu"] = quick_gelu
        clip = open_clip.create_model(name, pretrained=pretrained, precision=precision, device=device,
                                      force_quick_gelu=quick_gelu)
    return ClipModel(clip, model_cfg, tokenizer_source=_tokenizer_source(name, model_cfg), precision=precision)


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file; refuses pickled objects (torch.load with weights_only=True)."""
    path = str(path)
    if path.endswith(".safetensors"):
        obj = _load_safetensors(path)
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise InputError(path, "checkpoint", "holds pickled objects, refused (weights_only=True); "
                                                 "save a state dict of tensors instead") from error
        except (RuntimeError, EOFError, OSError, ValueError) as error:
            raise InputError(path, "checkpoint", f"cannot be read (truncated or corrupt?): {error}") from error
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(path, "checkpoint", "is not a state dict of tensors")
    for prefix in _WRAPPER_PREFIXES:
        if obj and all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return fold_kept_rows_state_dict(fold_lora_state_dict(obj))


def _load_safetensors(path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as error:   # safetensors raises its own SafetensorError (and OSError)
        raise InputError(path, "weights", f"cannot be read (truncated or corrupt?): {error}") from error


def load_state_dict_into(clip: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str = "") -> None:
    state_dict = dict(state_dict)
    resize_pos_embed(state_dict, clip)          # a checkpoint at another image size, as open_clip does
    _resize_timm_pos_embed(state_dict, clip)    # the same for a timm tower, with timm's own resampler
    try:
        clip.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:
        raise InputError(source, "state_dict", f"does not fit the model: {error}") from error


def export_model(model: ClipModel, out_dir: str | os.PathLike) -> Path:
    """Write `model` as an open_clip `local-dir:` folder (atomically); returns the folder."""
    clip = merge_lora(copy.deepcopy(model.clip))
    tensors = {k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()
               for k, v in fold_kept_rows_state_dict(clip.state_dict()).items()}
    config = {"model_cfg": model.export_config(), "preprocess_cfg": model.preprocess_cfg}
    with atomic_path(out_dir, is_dir=True) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out_dir)


def _as_local_dir(name: str) -> str | None:
    if not name:
        return None
    if name.startswith(LOCAL_DIR):
        return name
    if Path(name, CONFIG_FILE).is_file():
        return LOCAL_DIR + str(name)
    return None


@contextlib.contextmanager
def _quiet_random_init_warning():
    """Silence open_clip's "No pretrained weights loaded" while we load the weights ourselves."""
    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No pretrained weights loaded")

    root = logging.getLogger()
    root.addFilter(keep)
    try:
        yield
    finally:
        root.removeFilter(keep)


def _tokenizer_source(name: str, model_cfg: dict) -> str:
    """Where open_clip finds the tokenizer; "" (CLIP's BPE) whenever the config names no other, so
    every CLIP-BPE model shares one cached tokenizer and none depends on its export folder staying put."""
    uses_other = model_cfg["text_cfg"].get("hf_tokenizer_name") or "siglip" in name.lower()
    return name if uses_other else ""


def _resize_timm_pos_embed(state_dict: dict[str, torch.Tensor], clip: torch.nn.Module) -> None:
    """A timm tower's absolute position table at another grid -> timm's `resample_abs_pos_embed` (EVA's rotary
    embedding is computed from the grid, not stored)."""
    key = "visual.trunk.pos_embed"
    trunk = getattr(clip.visual, "trunk", None)
    table = state_dict.get(key)
    if trunk is None or table is None or getattr(trunk, "pos_embed", None) is None \
            or table.shape == trunk.pos_embed.shape:
        return
    from timm.layers import resample_abs_pos_embed

    prefix = 0 if getattr(trunk, "no_embed_class", False) else trunk.num_prefix_tokens
    state_dict[key] = resample_abs_pos_embed(table, list(trunk.patch_embed.grid_size), num_prefix_tokens=prefix)


def _checkpoint_context_length(state_dict: dict[str, torch.Tensor], model_cfg: dict) -> int:
    table = state_dict.get("positional_embedding", state_dict.get("text.positional_embedding"))
    return int(table.shape[0]) if table is not None else int(model_cfg["text_cfg"]["context_length"])
