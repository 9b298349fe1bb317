"""The Method protocol of DEVELOPERS.md as a base class with the optional parts filled in.

The trainer knows a method only through this interface; a new method is a new subclass, never a branch in the
loop. Construction: `cls(**config)`, where `config` is the run's resolved constructor kwargs (clipfinetune/runs.py:
its loss weights from params `loss`, what `runs.<run>` changes (`terms`, `unlocked_vision_layers`, `max_sentences`,
...), and the keys of `train.<method>` that the method lists in `train_keys`, e.g. MulCLIP's `new_module_lr`).
A subclass either names its keyword arguments (a typo in params.yaml then fails loudly) or reads `self.config`.

Features returned by `build(model)(batch)` must be tensors whose dim 0 indexes the batch's samples, or 0-dim
tensors shared by the batch (e.g. `logit_scale`): with `accum_steps > 1` the loop concatenates micro-batches'
features along dim 0 (open_clip's feature cache) before calling the loss.
"""
from __future__ import annotations

import random
from typing import Any, ClassVar

from torch import nn


class Method:
    # open_clip's optimiser conventions the forks inherit (METHODS.md 0.3): no weight decay on gains, biases and
    # logit_scale, and logit_scale clamped to [0, ln 100] after each step; a method whose paper's code does
    # neither (GOAL) turns them off
    weight_decay_exclusions: bool = True
    clamp_logit_scale: bool = True
    name: str = ""
    # the loss's term names -> the constructor weight that switches the term on (None: always computed); `custom`
    # mixes terms by these names ("<method>.<term>")
    terms: ClassVar[dict[str, str | None]] = {}
    train_keys: frozenset[str] = frozenset()    # extra keys allowed in params `train.<method>`
    find_unused_parameters: bool = False        # DDP: True if some trainable params may skip a forward
    uses_logit_scale: bool = True               # the model's own logit_scale enters this method's loss
    epoch_unit: str = "image"                   # what the paper's epoch iterates: image | caption | word_region

    def __init__(self, **config: Any):
        self.config = dict(config)

    # ----------------------------------------------------------------------------------- data (loader workers)
    def wants(self, record: dict) -> bool:
        """Does this shard record carry the fields this method needs?"""
        return True

    def make_example(self, record: dict, image, rng: random.Random, ctx) -> dict:
        """One training example (tensors/ints only) from a shard record and its decoded PIL image."""
        raise NotImplementedError(f"{type(self).__name__}.make_example")

    def units(self, record: dict) -> int:
        """How many `epoch_unit`s a wanted record holds (>= 1): the loader's epoch with `train.epoch_unit: method`
        visits each once."""
        return 1

    def unit_record(self, record: dict, unit: int) -> dict:
        """The record narrowed to its `unit`-th unit (0 <= unit < `units(record)`), so that `make_example` can only
        draw that unit; the image stays the record's."""
        return record

    # ----------------------------------------------------------------------------------- model and loss
    def build(self, model) -> nn.Module:
        """The module the trainer optimises (and DDP wraps): forward(batch) -> features dict."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def loss(self) -> nn.Module:
        """forward(features) -> {term name: weighted scalar tensor}; the trainer sums and logs them."""
        raise NotImplementedError(f"{type(self).__name__}.loss")

    # ----------------------------------------------------------------------------------- optional hooks
    def join_mix(self, terms: frozenset[str]) -> None:
        """Called by `custom` before `build`: the model is shared with other methods and only `terms` of this
        method's loss are summed. A method then freezes nothing of the shared model that another method may
        train (`custom` freezes the model's logit_scale when no method uses it) and only its own parameters
        that no summed term uses."""

    def param_groups(self, module: nn.Module) -> list[dict]:
        """Extra optimiser groups: [{"name", "params", "lr"[, "weight_decay"]}]; the rest uses `train.lr`."""
        return []

    def after_step(self, module: nn.Module) -> None:
        """Called after every optimiser step (e.g. DeGLA's EMA teacher update)."""

    def final_model(self, module: nn.Module, model):
        """The ClipModel to export after training (e.g. with LoRA merged); default: the model itself."""
        return model

    def state_dict(self) -> dict:
        """Extra state to checkpoint beyond `module.state_dict()` (teachers registered as submodules of the
        built module are already in it)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class CaptionUnits:
    """`epoch_unit` "caption" for methods that draw one of `record["captions"]`: an epoch is one pass over the
    image-caption pairs (the rows of open_clip's CSV/NegCLIP TSV loaders that CLIP fine-tuning and FSC-CLIP use)."""
    epoch_unit = "caption"

    def units(self, record: dict) -> int:
        return len(record["captions"])

    def unit_record(self, record: dict, unit: int) -> dict:
        return {**record, "captions": [record["captions"][unit]]}
