"""`custom`: any mix of the five methods' loss terms, by name (beyond the papers; issue 14).

    custom: {terms: {"fsc_clip.local_hn": 0.5, "degla.distill": 0.005, "harmoclip.global_region": 1.0}}

    L = w_clip * L_clip + sum over "<method>.<term>" of w * term                  (term at its method's lambda = 1)

The mix is a composition of the methods' own `Method` objects; nothing of their glue is re-implemented here.

Decisions:
- **The plain CLIP contrastive term is always in** (`ClipMethod`: one random short caption per image, symmetric
  InfoNCE), weight 1 unless `"clip.contrastive"` gives another; `"clip.contrastive": 0` removes it, and with it
  `ClipMethod`'s data filter (records with short captions). The other methods' always-on global terms (their own
  `contrastive`) are computed by their loss modules but NOT summed unless named (`"degla.contrastive"` is DeGLA's
  hard-negative L_base, `"goal.contrastive"` GOAL's long-caption L_global, ...).
- **Weights replace the methods' lambdas.** Each involved method is built with the lambdas of its requested terms
  set to 1 and every other lambda 0 (its loss then returns graph-connected zeros for those terms and skips their
  inputs, its features module skips their forwards, e.g. no teacher without a teacher term); the requested term
  is then multiplied by its weight. So `"degla.distill": 0.005` is DeGLA's own lambda_distill, and the mix equals
  the weighted sum of each method's own terms on the same batch (tested). A lambda shared by two terms
  (GOAL's lambda_tsl: `tsl_image`, `tsl_text`) switches both on; only the named ones are summed. The methods'
  other settings (focal_gamma, ema_alpha, unlocked_vision_layers, ...) are their defaults: `custom` reads only
  `custom.terms`.
- **Data**: a record is wanted only if EVERY involved method wants it, and each method makes its own example from
  it with the same `rng` (in mix order), so each term sees exactly the data its method would. Fields are namespaced
  `"<method>.<field>"`, except `image`, which every method computes as `ctx.transform(image)` and which is stored
  once (a method whose `image` differs is an error: sharing it would silently change that method's input).
  Consequence: with harmoclip + degla + fsc_clip (+ clip) only COCO records having word regions AND LLM negatives
  train; mixing a DOCCI method (goal, mulclip) with a COCO one wants nothing (records are one or the other), so
  goal/mulclip terms need `"clip.contrastive": 0` and no COCO method.
- **Features computed once where shared**: the forward runs inside the shared model's `reusing_features()`
  (`ClipModel`: within the block a feature call on an input tensor already seen returns the first result; the shared
  `image` is one tensor object for every method). `encode_*(x)` is then served as `*_features(x)["global_"]` (the
  same computation, bit for bit) and a `dense=False` image request reuses a `dense=True` result. Teachers are
  separate modules and are not shared. Features are returned flat as `"<method>.<key>"` (the trainer's accumulation
  cache concatenates them along dim 0).
- Every method builds on the SAME model (teachers copy it at their build, in mix order). Each method is told its
  summed terms first (`Method.join_mix`): it then freezes only what no summed term of its own uses (MulCLIP: its
  global head when neither of its global terms is named) and nothing of the shared model; a parameter of the model
  is frozen here only if no involved method reads it (`Method.unused_model_parameters`: MulCLIP's terms do not read
  the model's logit_scale). So GOAL's terms keep training CLIP's temperature next to MulCLIP's own heads, and no
  trainable parameter is left without a gradient.
- Hooks: parameter groups, `clamp`, `after_step` and `final_model` are each method's own, on its part of the built
  module (a GOAL term does not clamp the logit scale, a CLIP term does); weight decay follows open_clip's rule.
- The trainer sums the returned terms, named `"<method>.<term>"`; the losses' counts are merged into `stats`.
"""
from __future__ import annotations

import math
import random

import torch
from torch import nn

from . import build_method, get_method
from .base import Method


def terms_of_methods() -> dict[str, dict[str, str | None]]:
    """method -> {term: the constructor lambda that switches the term on, None = always computed by its loss}, from
    each registered method's own `terms` (the registry's order)."""
    from clipfinetune.registry import METHODS

    return {m: get_method(m).terms for m in METHODS}


SHARED_FIELDS = ("image",)


def _terms_of(method: str) -> dict[str, str | None] | None:
    """A registered method's `terms` (None: no such method). Only the methods a mix names are loaded, so a run's
    code is theirs (`CustomMethod.methods_run`), not every registered method's."""
    from clipfinetune.registry import METHODS

    return get_method(method).terms if method in METHODS else None


def parse_terms(terms: dict) -> dict[str, dict[str, float]]:
    """{"<method>.<term>": weight} -> {method: {term: weight}} (clip first, then in order); 0 weights dropped."""
    weights: dict[str, dict[str, float]] = {"clip": {"contrastive": 1.0}}
    for key, weight in (terms or {}).items():
        method, _, term = str(key).partition(".")
        if term not in (_terms_of(method) or {}):
            known = ", ".join(f"{m}.{t}" for m, ts in terms_of_methods().items() for t in ts)
            raise ValueError(f"custom.terms: unknown term {key!r}; known: {known}")
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"custom.terms: weight of {key!r} is {weight}")
        weights.setdefault(method, {})[term] = weight
    weights = {m: {t: w for t, w in ts.items() if w != 0} for m, ts in weights.items()}
    weights = {m: ts for m, ts in weights.items() if ts}
    if not weights:
        raise ValueError("custom.terms: every weight is 0, nothing to train")
    return weights


def method_config(method: str, terms: dict[str, float]) -> dict[str, float]:
    """The method's lambdas: 1 for the requested terms, 0 for the others."""
    lambdas = get_method(method).terms
    config = {lam: 0.0 for lam in lambdas.values() if lam}
    config.update({lambdas[t]: 1.0 for t in terms if lambdas[t]})
    return config


class CustomModule(nn.Module):
    """The methods' feature modules over one shared model; forward(batch) -> flat "<method>.<key>" features."""

    def __init__(self, model, parts: dict[str, nn.Module]):
        super().__init__()
        self.parts = nn.ModuleDict(parts)
        self.model = model                  # the parts' shared model (its parameters are the parts' own, not copies)

    def forward(self, batch: dict) -> dict:
        features = {}
        with self.model.reusing_features():
            for name, part in self.parts.items():
                prefix = f"{name}."
                view = {k[len(prefix):]: v for k, v in batch.items() if k.startswith(prefix)}
                view.update({k: batch[k] for k in SHARED_FIELDS if k in batch})
                features.update({prefix + k: v for k, v in part(view).items()})
        return features


class CustomLoss(nn.Module):
    """Each method's loss on its own features; returns w * term for the requested terms, as "<method>.<term>"."""

    def __init__(self, losses: dict[str, nn.Module], weights: dict[str, dict[str, float]]):
        super().__init__()
        self.losses = nn.ModuleDict(losses)
        self.weights = weights
        self.stats: dict[str, int] = {}

    def forward(self, features: dict) -> dict[str, torch.Tensor]:
        out, stats = {}, {}
        for name, loss in self.losses.items():
            prefix = f"{name}."
            terms = loss({k[len(prefix):]: v for k, v in features.items() if k.startswith(prefix)})
            out.update({prefix + t: w * terms[t] for t, w in self.weights[name].items()})
            stats.update({prefix + k: v for k, v in (getattr(loss, "stats", None) or {}).items()})
        self.stats = stats
        return out


class CustomMethod(Method):
    name = "custom"
    epoch_unit = "image"            # a mix: its methods' units differ, so one example per image (each draws its own)

    def __init__(self, terms: dict | None = None):
        self.weights = parse_terms(terms or {})
        self.methods: dict[str, Method] = {m: build_method(m, **method_config(m, ts))
                                           for m, ts in self.weights.items()}
        for name, method in self.methods.items():
            method.join_mix(frozenset(self.weights[name]))

    @classmethod
    def methods_run(cls, config: dict) -> tuple[str, ...]:
        return (cls.name, *parse_terms(config.get("terms") or {}))

    def wants(self, record: dict) -> bool:
        return all(m.wants(record) for m in self.methods.values())

    def prepared_tables(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys(t for m in self.methods.values() for t in m.prepared_tables()))

    def caption_kinds(self) -> set[str]:
        return set().union(*(m.caption_kinds() for m in self.methods.values())) if self.methods else {"short"}

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        example: dict = {}
        for name, method in self.methods.items():
            for key, value in method.make_example(record, image, rng, ctx).items():
                if key not in SHARED_FIELDS:
                    example[f"{name}.{key}"] = value
                elif key not in example:
                    example[key] = value
                elif not torch.equal(example[key], value):
                    raise ValueError(f"custom: method {name!r} makes a different {key!r} for record "
                                     f"{record.get('image_id')!r}; it cannot share the mix's {key!r}")
        return example

    def build(self, model) -> nn.Module:
        parts = {name: m.build(model) for name, m in self.methods.items()}
        unused = set.intersection(*({id(p) for p in m.unused_model_parameters(model)} for m in self.methods.values()))
        for p in model.parameters():
            if id(p) in unused:
                p.requires_grad_(False)                            # no term of the mix reads it (DDP, decay)
        return CustomModule(model, parts)

    def loss(self) -> nn.Module:
        return CustomLoss({name: m.loss() for name, m in self.methods.items()}, self.weights)

    def param_groups(self, module: nn.Module) -> list[dict]:
        return [dict(g, name=f"{name}.{g.get('name', i)}")
                for name, m in self.methods.items()
                for i, g in enumerate(m.param_groups(module.parts[name]))]

    def clamp(self, module: nn.Module) -> None:
        for name, m in self.methods.items():
            m.clamp(module.parts[name])

    def after_step(self, module: nn.Module) -> None:
        for name, m in self.methods.items():
            m.after_step(module.parts[name])

    def final_model(self, module: nn.Module, model):
        for name, m in self.methods.items():
            model = m.final_model(module.parts[name], model)
        return model

    def state_dict(self) -> dict:
        return {name: m.state_dict() for name, m in self.methods.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, m in self.methods.items():
            m.load_state_dict(state.get(name, {}))
