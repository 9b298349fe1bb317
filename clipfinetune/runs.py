"""A run's effective settings: the one place that turns params `loss`, `runs`, `train` and `model.precision` into what
train@<run> trains with. The caller passes the params mapping (the library never reads params.yaml).

    resolve_runs(params)["fsc_lhn_only"] == {"method": "fsc_clip",
        "config": {"lambda_g": 0.0, "lambda_l": 0.5, "focal_gamma": 2.0, "label_smoothing": 0.02},  # constructor kwargs
        "train": {"epochs": 2, "batch_size": 64, "lr": 2e-4, ...},        # train.* merged with train.fsc_clip.*
        "precision": "auto"}                                              # model.precision, as configured

The rule a user needs:
- `loss` holds each method's loss weights by the papers' symbols, flat (`loss.lambda_l` is FSC-CLIP's lambda_L). A
  key belongs to the method whose constructor takes it (exactly one: the flat names must not collide), and every run
  of that method takes it from there.
- `runs.<run>` is the run's `method` and what the run changes: a loss weight for this run alone (an ablation names
  only the weight it zeroes; `runs.fsc_clip.lambda_l`, the older spelling of a sweep, overrides `loss` for that run),
  or one of the method's other constructor arguments (HarmoCLIP's `unlocked_vision_layers`, MulCLIP's
  `max_sentences`, the mix's `terms`), which otherwise keep the method's own default.
- `train` holds the shared training settings and `train.<method>` a method's overrides of them, plus the extra keys
  its method lists in `train_keys` (MulCLIP's `new_module_lr`), which go to the constructor.
- `model.precision` (auto | bf16 | fp16 | fp32) is passed through; `train.config.resolve_precision` turns it into
  what runs on the device the run gets.
Anything else fails here, naming the key: a typo never trains silently with a default.
"""
from __future__ import annotations

import inspect

STAGE_ONLY_TRAIN_KEYS = ("keep_checkpoint",)     # train.* keys the train stage reads itself: not a training setting
# train.* keys of older params files that are now the host's (clipfinetune/host.py): ignored wherever they stand, so
# they reach no run's settings and re-train nothing
HOST_TRAIN_KEYS = ("workers",)
PRECISION_SETTINGS = ("auto", "bf16", "fp16", "fp32")


def constructor_arguments(method: str) -> frozenset[str]:
    """The keyword arguments a method's class takes (its loss weights and its other settings)."""
    from clipfinetune.methods import get_method

    return frozenset(inspect.signature(get_method(method).__init__).parameters) - {"self"}


def loss_owners(loss: dict, methods) -> dict[str, str]:
    """params `loss` key -> the one method whose constructor takes it; a key no method takes, or two do, fails."""
    owners: dict[str, str] = {}
    for key in loss:
        takers = [m for m in methods if key in constructor_arguments(m)]
        if len(takers) != 1:
            said = f"taken by {takers}: rename it" if takers else "no method takes it"
            raise ValueError(f"params loss.{key}: {said} (each key is one method's loss weight; "
                             f"methods: {', '.join(methods)})")
        owners[key] = takers[0]
    return owners


def method_train_groups(train: dict, methods) -> tuple[dict, dict[str, dict]]:
    """params `train` -> (the shared settings, {method: its override group}). A group that is no method's fails."""
    groups = {k: {g: x for g, x in (v or {}).items() if g not in HOST_TRAIN_KEYS}
              for k, v in train.items() if isinstance(v, dict)}
    stray = sorted(set(groups) - set(methods))
    if stray:
        raise ValueError(f"params train: groups {stray} are no method's (methods: {', '.join(methods)})")
    shared = {k: v for k, v in train.items()
              if k not in groups and k not in STAGE_ONLY_TRAIN_KEYS and k not in HOST_TRAIN_KEYS}
    return shared, groups


def resolve_run(name: str, run: dict, loss: dict, owners: dict[str, str], shared: dict, groups: dict,
                precision: str) -> dict:
    from clipfinetune.methods import METHODS, get_method
    from clipfinetune.train.config import TRAIN_KEYS, merge_train_settings

    if not isinstance(run, dict) or "method" not in run:
        raise ValueError(f"params runs.{name}: a run is a mapping with its `method` (one of {', '.join(METHODS)})")
    method, changes = run["method"], {k: v for k, v in run.items() if k != "method"}
    if method not in METHODS:
        raise ValueError(f"params runs.{name}.method: unknown method {method!r} (methods: {', '.join(METHODS)})")
    accepted = constructor_arguments(method)
    for key in changes:
        if key in accepted:
            continue
        if key in owners:
            hint = f"it is {owners[key]}'s loss weight (loss.{key})"
        elif key in TRAIN_KEYS:
            hint = f"a training setting goes in train.{method}.{key}"
        else:
            hint = f"{method}'s arguments: {', '.join(sorted(accepted)) or 'none'}"
        raise ValueError(f"params runs.{name}.{key}: not an argument of method {method} ({hint})")
    settings, extras = merge_train_settings(shared, groups.get(method), get_method(method).train_keys,
                                            f"params train.{method}")
    clash = sorted(set(changes) & set(extras))
    if clash:
        raise ValueError(f"params runs.{name}: {clash} set in both runs.{name} and train.{method}")
    weights = {k: v for k, v in loss.items() if owners[k] == method}
    return {"method": method, "config": {**weights, **extras, **changes}, "train": settings, "precision": precision}


def batch_param(params: dict, method: str) -> str:
    """The param that sets a method's runs' global batch: `train.<method>.batch_size` where the method overrides it."""
    own = (params.get("train") or {}).get(method) or {}
    return f"train.{method}.batch_size" if "batch_size" in own else "train.batch_size"


def resolve_runs(params: dict) -> dict[str, dict]:
    """Every run of params `runs` -> its effective settings: {"method", "config" (the method's constructor kwargs:
    its weights from `loss`, the run's own changes, its `train.<method>` extras), "train" (train.* merged with
    train.<method>.*: batch_size is the GLOBAL batch), "precision" (model.precision)}."""
    from clipfinetune.methods import METHODS

    loss = dict(params.get("loss") or {})
    owners = loss_owners(loss, METHODS)
    shared, groups = method_train_groups(dict(params["train"]), METHODS)
    precision = params["model"]["precision"]
    if precision not in PRECISION_SETTINGS:
        raise ValueError(f"params model.precision: {precision!r} is not one of {', '.join(PRECISION_SETTINGS)}")
    return {name: resolve_run(name, run, loss, owners, shared, groups, precision)
            for name, run in (params["runs"] or {}).items()}
