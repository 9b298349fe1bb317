"""The Method protocol of DEVELOPERS.md as a base class with the optional parts filled in.

The trainer knows a method only through this interface; a new method is a new subclass, never a branch in the
loop. What differs between methods is a hook here, called by the trainer without asking who answers; the defaults
are open_clip's conventions (`clipfinetune/conventions.py`, docs/methods.md §0.3; a method never imports the trainer).
Construction: `cls(**config)`, where `config` is the run's resolved constructor kwargs (clipfinetune/runs.py: its
loss weights from params `loss`, what `runs.<run>` changes (`terms`, `unlocked_vision_layers`, `max_sentences`, ...),
and the keys of `train.<method>` that the method lists in `train_keys`, e.g. MulCLIP's `new_module_lr`).
A subclass names its keyword arguments, so that a typo in params.yaml fails loudly.

Features returned by `build(model)(batch)` must be tensors whose dim 0 indexes the batch's samples, or 0-dim
tensors shared by the batch (e.g. `logit_scale`): with `accum_steps > 1` the loop concatenates micro-batches'
features along dim 0 (open_clip's feature cache) before calling the loss. The built module holds the ClipModel as
`module.model`. A loss may own parameters (`loss().parameters()`): they must be parameters of the built module too
(DDP syncs them, checkpoints carry them; e.g. `build` registers the loss as a submodule and `loss()` returns that
instance), their learning rate comes from `param_groups`, and with accumulation their gradient is taken in one pass.
Every trainable parameter must get a gradient at every step (freeze what a run does not use): DDP runs without
`find_unused_parameters`.
"""
from __future__ import annotations

import random
from typing import ClassVar

import torch
from torch import nn

from clipfinetune.conventions import MAX_LOGIT_SCALE, no_weight_decay


class Method:
    name: str = ""
    # the loss's term names -> the constructor weight that switches the term on (None: always computed); `custom`
    # mixes terms by these names ("<method>.<term>")
    terms: ClassVar[dict[str, str | None]] = {}
    train_keys: frozenset[str] = frozenset()    # extra keys allowed in params `train.<method>`
    epoch_unit: str = "image"                   # what the paper's epoch iterates: image | caption | word_region
    # the records it trains on, as the project's tools (clipfinetune plan) ask: "short" captions (COCO-format) or a
    # "long" caption (DOCCI-format)
    caption_kind: str = "short"

    @classmethod
    def methods_run(cls, config: dict) -> tuple[str, ...]:
        """The methods whose modules a run of this method with constructor kwargs `config` loads: its own (the
        mix: the methods it names). Their code digests are the run's code (stage run_settings)."""
        return (cls.name,)

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

    # ----------------------------------------------------------------------------------- hooks the trainer calls
    def param_groups(self, module: nn.Module) -> list[dict]:
        """Extra optimiser groups: [{"name", "params", "lr"[, "weight_decay"]}] (e.g. parameters the loss owns at
        their own learning rate); every other trainable parameter trains at `train.lr`."""
        return []

    def no_weight_decay(self, name: str, param: torch.Tensor) -> bool:
        """Whether the optimiser leaves this trainable parameter of the built module undecayed: open_clip's rule
        (gains, biases, embeddings of ndim < 2, the logit scale)."""
        return no_weight_decay(name, param)

    def clamp(self, module: nn.Module) -> None:
        """After every optimiser step, under no_grad: bring parameters back into their range. open_clip clamps the
        model's logit scale to [0, ln 100] (a frozen one is left as it is)."""
        scale = module.model.clip.logit_scale
        if scale.requires_grad:
            scale.clamp_(0, MAX_LOGIT_SCALE)

    def after_step(self, module: nn.Module) -> None:
        """Called after every optimiser step and `clamp` (e.g. DeGLA's EMA teacher update)."""

    def final_model(self, module: nn.Module, model):
        """The ClipModel to export after training (e.g. with LoRA merged); default: the model itself."""
        return model

    def state_dict(self) -> dict:
        """Extra state to checkpoint beyond `module.state_dict()` (teachers registered as submodules of the
        built module are already in it)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # ----------------------------------------------------------------------------------- what the planner asks
    def prepared_tables(self) -> list[tuple[str, str]]:
        """The prepared tables this configuration's records need, as (what, the data stage writing it), e.g.
        [("word-region pairs", "word_regions")]; [] when the shards' captions are all it reads."""
        return []

    def tables_switched_off_by(self) -> tuple[str, ...]:
        """Constructor weights which, all 0, leave `prepared_tables` unread (a configuration of this method that
        trains without them); () when none does."""
        return ()

    def caption_kinds(self) -> set[str]:
        """The kinds of caption (`caption_kind`) this configuration's records must hold."""
        return {self.caption_kind}

    def units_table(self) -> str:
        """With `train.epoch_unit: method`, the data stage whose table's rows are the epoch's units (counted there
        before the shards exist); "" when the units come from the records (`epoch_unit` image or caption)."""
        return ""

    # ----------------------------------------------------------------------------------- composition (`custom`)
    def join_mix(self, terms: frozenset[str]) -> None:
        """Called by `custom` before `build`: the model is shared with other methods and only `terms` of this
        method's loss are summed. A method then freezes nothing of the shared model that another method may
        train (`custom` freezes what no method of the mix reads, `unused_model_parameters`) and only its own
        parameters that no summed term uses."""

    def unused_model_parameters(self, model) -> list[nn.Parameter]:
        """Parameters of the model that no term of this method reads (e.g. a loss with its own temperature
        leaves the model's logit scale unused). A method alone freezes them in `build` (else they would drift
        under weight decay and DDP would wait for their gradient); in a mix `custom` freezes those that no method
        of the mix reads."""
        return []


class CaptionUnits:
    """`epoch_unit` "caption" for methods that draw one of `record["captions"]`: an epoch is one pass over the
    image-caption pairs (the rows of open_clip's CSV/NegCLIP TSV loaders that CLIP fine-tuning and FSC-CLIP use)."""
    epoch_unit = "caption"

    def units(self, record: dict) -> int:
        return len(record["captions"])

    def unit_record(self, record: dict, unit: int) -> dict:
        return {**record, "captions": [record["captions"][unit]]}
