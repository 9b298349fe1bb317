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
- QuickGELU follows the weights (an activation has no weights, so a checkpoint cannot show it): an open_clip
  tag's metadata (`quick_gelu` of the tag or its config, e.g. OpenAI's); an exported folder's
  `open_clip_config.json`; for a file, its own record (an `open_clip_config.json` beside it, a `quick_gelu` key
  saved with the weights: safetensors metadata "true"/"false" or a top-level key of a torch checkpoint dict; a
  TorchScript archive is OpenAI's, QuickGELU), the config's own `quick_gelu` key (a "-quickgelu" name, the
  bundled configs) and the `quick_gelu` argument (the stages' `model.quick_gelu`). These must agree; a file that
  none of them covers is an error asking for the argument, never a silent GELU. Random init: the argument, else
  the config. The export records the activation, so the exported folder needs no "-quickgelu" name.
- OpenAI's original TorchScript archives (`ViT-B-16.pt` of openaipublic / the `clip` package) are read by
  open_clip's own OpenAI loader (`load_openai_model`: `torch.jit.load`, its fp16 weights as OpenAI built them);
  every other torch file goes through `torch.load(weights_only=True)`.
- Offline, a tag loads from the Hugging Face cache (`HF_HUB_OFFLINE=1`, `HF_HUB_CACHE`/`HF_HOME`); a tag that is
  neither cached nor downloadable is an error that says so.
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
import warnings
import zipfile
from pathlib import Path

import open_clip
import torch
from open_clip.model import resize_pos_embed
from safetensors import safe_open
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
QUICK_GELU_KEY = "quick_gelu"      # the record saved with a checkpoint's weights (safetensors metadata / dict key)
QUICK_GELU_PARAM = "model.quick_gelu"


def register_bundled_configs() -> None:
    """Make `configs/*.json` (e.g. `cft-tiny-vit`) known to open_clip by name; idempotent."""
    if not all(p.stem in open_clip.list_models() for p in CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(CONFIG_DIR)


def load_model(name: str, pretrained: str = "", device: str | torch.device = "cpu",
               precision: str = "fp32", quick_gelu: bool | None = None) -> ClipModel:
    """`quick_gelu`: the activation the weights were trained with (True = QuickGELU), for weights that do not
    record it; None follows the weights. Contradicting their record is an error."""
    register_bundled_configs()
    exported = _as_local_dir(name) or _as_local_dir(pretrained)
    if exported:
        folder = Path(exported[len(LOCAL_DIR):])
        model_cfg = json.loads((folder / CONFIG_FILE).read_text())["model_cfg"]
        _agreed_quick_gelu(folder / CONFIG_FILE, [(bool(model_cfg.get("quick_gelu", False)), CONFIG_FILE)],
                           quick_gelu)
        if (folder / WEIGHTS_FILE).is_file():
            _load_safetensors(folder / WEIGHTS_FILE)       # a truncated/corrupt file: a clear error naming it
        clip = open_clip.create_model(exported, precision=precision, device=device)
        return ClipModel(clip, model_cfg, tokenizer_source=_tokenizer_source(exported, model_cfg), precision=precision)

    model_cfg = open_clip.get_model_config(name)
    if model_cfg is None:
        raise ValueError(f"unknown model {name!r}: not an open_clip/bundled config nor an exported folder")
    config_claim = [(bool(model_cfg["quick_gelu"]), f"config {name!r}")] if "quick_gelu" in model_cfg else []
    if not pretrained:
        model_cfg["quick_gelu"] = quick_gelu if quick_gelu is not None else bool(model_cfg.get("quick_gelu", False))
        clip = _create_model(name, model_cfg["quick_gelu"], precision=precision, device=device)
    elif os.path.isfile(pretrained):
        state_dict, records = _read_checkpoint(pretrained)
        model_cfg["quick_gelu"] = _agreed_quick_gelu(pretrained, records + config_claim, quick_gelu)
        context_length = _checkpoint_context_length(state_dict, model_cfg)
        model_cfg["text_cfg"]["context_length"] = context_length
        with _quiet_random_init_warning():      # the weights come next, from the file
            clip = _create_model(name, model_cfg["quick_gelu"], precision=precision, device=device,
                                 force_context_length=context_length)
        load_state_dict_into(clip, state_dict, pretrained)
    else:
        tag_cfg = open_clip.get_pretrained_cfg(name, pretrained)
        if not tag_cfg:
            raise ValueError(f"pretrained {pretrained!r} is neither a file, an exported folder, "
                             f"nor an open_clip tag of {name!r}")
        tag_quick_gelu = bool(tag_cfg.get("quick_gelu", False)) or bool(model_cfg.get("quick_gelu", False))
        model_cfg["quick_gelu"] = _agreed_quick_gelu(
            f"{name} {pretrained}", [(tag_quick_gelu, "open_clip's metadata of the tag")], quick_gelu)
        try:
            clip = _create_model(name, model_cfg["quick_gelu"], pretrained=pretrained, precision=precision,
                                 device=device)
        except RuntimeError as error:
            if not str(error).startswith("Failed to download"):
                raise
            raise RuntimeError(
                f"weights of {name} {pretrained!r} are neither in the Hugging Face cache nor downloadable ({error}). "
                f"Offline: fill the cache once where there is network (load the tag once, or `hf download "
                f"{tag_cfg.get('hf_hub', '').rstrip('/')}`), point HF_HUB_CACHE (or HF_HOME) at it and set "
                f"HF_HUB_OFFLINE=1; or export the weights to a folder and name it (docs/real-architectures.md, "
                f"\"Loading real weights\")"
            ) from error
    return ClipModel(clip, model_cfg, tokenizer_source=_tokenizer_source(name, model_cfg), precision=precision)


def quick_gelu_setting(value: str | bool) -> bool | None:
    """The `model.quick_gelu` param: "auto" (follow the weights) -> None; true/false -> that."""
    if value == "auto":
        return None
    if isinstance(value, bool):
        return value
    raise ValueError(f"{QUICK_GELU_PARAM} must be auto, true or false, not {value!r}")


def _create_model(name: str, quick_gelu: bool, **kwargs) -> torch.nn.Module:
    # `quick_gelu` as a model kwarg also turns a "-quickgelu" config's QuickGELU off; `force_quick_gelu` keeps
    # open_clip's tag check (a warning on a mismatch) quiet when it is on
    return open_clip.create_model(name, force_quick_gelu=quick_gelu, quick_gelu=quick_gelu, **kwargs)


def _agreed_quick_gelu(source, claims: list[tuple[bool, str]], requested: bool | None) -> bool:
    """The activation every claim about the weights (value, who says it) and the request agree on."""
    if requested is not None:
        claims = claims + [(requested, f"{QUICK_GELU_PARAM} (quick_gelu argument)")]
    if not claims:
        raise InputError(source, "quick_gelu", f"the weights do not record their activation (QuickGELU or GELU) "
                                               f"and their config sets none: set {QUICK_GELU_PARAM}: true for "
                                               "weights trained with QuickGELU (OpenAI's, and the open_clip tags "
                                               "whose metadata says quick_gelu), false for GELU (e.g. LAION-2B's)")
    if len({value for value, _ in claims}) > 1:
        said = "; ".join(f"{who}: quick_gelu={value}" for value, who in claims)
        raise InputError(source, "quick_gelu", f"disagreement about the activation of these weights ({said})")
    return claims[0][0]


def read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint file; refuses pickled objects (torch.load with weights_only=True)."""
    return _read_checkpoint(path)[0]


def _read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], list[tuple[bool, str]]]:
    """The state dict of a checkpoint file, and what the file records about its activation (value, where)."""
    path = str(path)
    records = _sibling_config_record(path)
    if _is_torchscript_archive(path):
        return _read_torchscript(path), records + [(True, "a TorchScript archive (OpenAI's)")]
    if path.endswith(".safetensors"):
        obj = _load_safetensors(path)
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
        if QUICK_GELU_KEY in metadata:
            records.append((_parse_record(path, metadata[QUICK_GELU_KEY]), "its safetensors metadata"))
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            raise InputError(path, "checkpoint", "holds pickled objects, refused (weights_only=True); "
                                                 "save a state dict of tensors instead") from error
        except (RuntimeError, EOFError, OSError, ValueError) as error:
            raise InputError(path, "checkpoint", f"cannot be read (truncated or corrupt?): {error}") from error
        if isinstance(obj, dict) and QUICK_GELU_KEY in obj:
            records.append((_parse_record(path, obj.pop(QUICK_GELU_KEY)), f"its {QUICK_GELU_KEY!r} key"))
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise InputError(path, "checkpoint", "is not a state dict of tensors")
    for prefix in _WRAPPER_PREFIXES:
        if obj and all(k.startswith(prefix) for k in obj):
            obj = {k[len(prefix):]: v for k, v in obj.items()}
    return fold_kept_rows_state_dict(fold_lora_state_dict(obj)), records


def _parse_record(path: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InputError(path, QUICK_GELU_KEY, f"must be true or false, not {value!r}")


def _sibling_config_record(path: str) -> list[tuple[bool, str]]:
    """An open_clip folder (an export, a Hugging Face snapshot) describes the weights file inside it."""
    config = Path(path).parent / CONFIG_FILE
    if not config.is_file():
        return []
    model_cfg = json.loads(config.read_text()).get("model_cfg", {})
    return [(bool(model_cfg.get("quick_gelu", False)), str(config))]


def _is_torchscript_archive(path: str) -> bool:
    """A TorchScript zip holds `<name>/constants.pkl`, which `torch.save` never writes."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(entry.split("/", 1)[-1] == "constants.pkl" for entry in archive.namelist())


def _read_torchscript(path: str) -> dict[str, torch.Tensor]:
    """OpenAI's original archive, through open_clip's OpenAI loader (it rebuilds OpenAI's CLIP from the archive's
    weights); the state dict is then loaded into the named config like any checkpoint."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)     # torch.jit.load's deprecation notice
            clip = open_clip.load_openai_model(path, precision="fp32", device="cpu")
    except Exception as error:      # torch.jit / KeyError on a layout that is not OpenAI's
        raise InputError(path, "checkpoint", "is a TorchScript archive that open_clip's OpenAI loader cannot "
                                             f"read: {error!r}") from error
    return clip.state_dict()


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
