"""Training settings: one dataclass, and the rule that merges shared defaults with a method's overrides.

`batch_size` is the per-rank batch of ONE optimiser step. With `accum_steps = k` the loader yields micro-batches
of `batch_size / k` and the loop accumulates k of them (open_clip's feature cache, see `loop.py`), so `k` is a
memory knob that leaves the optimisation unchanged; the global batch is `batch_size * world_size`. The `train`
stage's param `train.batch_size` (and pretrain's `pretrain.batch_size`) is the GLOBAL batch (the papers' number):
`per_rank_batch_size` splits it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
TRAIN_TRANSFORMS = ("squash", "random_resized_crop")


@dataclass(frozen=True)
class TrainConfig:
    epochs: int
    batch_size: int                 # per rank, per optimiser step (micro-batch = batch_size // accum_steps)
    lr: float
    warmup: int = 0                 # linear warm-up, optimiser steps
    wd: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.98             # open_clip's ViT defaults (docs/methods.md §0.3)
    eps: float = 1e-6
    grad_clip: float = 0.0          # max global grad norm; 0 = off
    accum_steps: int = 1
    checkpoint_every: int = 0       # optimiser steps; 0 = only the final checkpoint
    seed: int = 0
    workers: int = 0                # loader worker processes
    epoch_unit: str = "image"       # image: one example per image an epoch; method: the method's own unit (loader.py)
    epoch_samples: int = 0          # > 0: every epoch runs over a fixed seeded sample of that many units (loader.py)
    train_transform: str = "squash"  # squash (the model's eval resize) | random_resized_crop (open_clip's is_train)
    precision: str = "fp32"         # fp32 | bf16 | fp16 (autocast; fp16 adds a GradScaler: `resolve_precision`)
    compile: bool = False           # torch.compile the (DDP-wrapped) model: its forward and backward (loop.py)
    log_every: int = 10             # optimiser steps per fetch of the logged values from the device (loop.py)

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {'/'.join(PRECISIONS)}, got {self.precision!r}")
        if self.accum_steps < 1 or self.batch_size % self.accum_steps:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of accum_steps {self.accum_steps}")
        if self.epoch_unit not in ("image", "method"):
            raise ValueError(f"epoch_unit must be image or method, got {self.epoch_unit!r}")
        if self.train_transform not in TRAIN_TRANSFORMS:
            raise ValueError(f"train_transform must be one of {TRAIN_TRANSFORMS}, got {self.train_transform!r}")
        if self.epoch_samples < 0:
            raise ValueError(f"epoch_samples must be >= 0 (0 = every unit), got {self.epoch_samples}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be true or false, got {self.compile!r}")  # noqa: TRY004  (as its siblings)
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size must be >= 1")
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1 (optimiser steps), got {self.log_every}")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.accum_steps

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def per_rank_batch_size(global_batch: int, world_size: int, param: str = "train.batch_size") -> int:
    """Each rank's share of the global batch, so that steps per epoch and the schedule do not depend on the
    number of ranks; an error naming the param (`param`) and both numbers when it does not divide."""
    if global_batch < 1 or world_size < 1:
        raise ValueError(f"global batch {global_batch} and world size {world_size} must be >= 1")
    if global_batch % world_size:
        raise ValueError(f"{param} {global_batch} (the global batch) is not divisible by the {world_size} "
                         f"ranks: choose a multiple of {world_size} or another compute.train_nproc")
    return global_batch // world_size


TRAIN_KEYS = frozenset(f.name for f in dataclasses.fields(TrainConfig)) - {"precision"}


def merge_train_settings(shared: dict, override: dict | None, extra_keys=frozenset(),
                         where: str = "train") -> tuple[dict, dict]:
    """Shared `train.*` defaults + a method's `train.<method>.*` group.

    A key of the override group replaces the shared one. Keys outside the shared set are allowed only if the
    method lists them in `extra_keys` (a method's `train_keys`); anything else is an error, so a typo
    never silently trains with the default. Returns (training settings, method extras).
    """
    override = override or {}
    unknown_shared = set(shared) - TRAIN_KEYS
    if unknown_shared:
        raise ValueError(f"{where}: unknown shared training keys {sorted(unknown_shared)}; known: {sorted(TRAIN_KEYS)}")
    unknown = set(override) - TRAIN_KEYS - set(extra_keys)
    if unknown:
        raise ValueError(f"{where}: unknown override keys {sorted(unknown)}; allowed: shared keys "
                         f"{sorted(TRAIN_KEYS)} and this method's {sorted(extra_keys) or 'none'}")
    settings = {**shared, **{k: v for k, v in override.items() if k in TRAIN_KEYS}}
    extras = {k: v for k, v in override.items() if k not in TRAIN_KEYS}
    return settings, extras


def resolve_precision(precision: str, device, log=None) -> str:
    """The precision a stage trains in on `device`, from `model.precision`:
    - auto: bf16 autocast where the device computes bf16 natively (a CUDA GPU with bf16 units, a CPU with
      AVX512-BF16 / AMX), fp32 otherwise: an emulated bf16 (older CPUs, pre-Ampere GPUs) gives the same numbers as
      native bf16 at about 3x fp32's time on a CPU (benchmarks/cpu_precision.py), so fp32 is the fast choice there;
    - bf16 (open_clip_train's `amp_bf16`) on CUDA and on CPU alike; emulated on a CPU without native bf16, which is
      said (same result, slower than fp32);
    - fp16 (open_clip_train's `amp`: fp16 autocast + GradScaler) on CUDA; on a CPU (no fast fp16 kernels) it falls
      back to bf16 with a warning;
    - fp32: no autocast.
    Results differ across CPUs and precisions at the last digits; the stages record the resolved precision."""
    device_type = getattr(device, "type", str(device))
    if precision == "auto":
        native = native_bf16(device_type)
        precision = "bf16" if native else "fp32"
        if log is not None:
            log.info("precision auto: %s on %s (%s)", precision, device_type,
                     "native bf16" if native else "no native bf16: fp32 is faster than emulated bf16")
    if precision not in PRECISIONS:
        raise ValueError(f"model.precision must be auto or one of {'/'.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp16" and device_type != "cuda":
        if log is not None:
            log.warning("precision fp16 (open_clip's amp: fp16 autocast + GradScaler) needs CUDA; on %s it trains "
                        "in bf16 autocast instead (other numbers than the papers' fp16)", device_type)
        precision = "bf16"
    if precision == "bf16" and log is not None:
        said = f"precision bf16: bf16 autocast on {device_type}"     # one opening on every host: logs grep it
        if device_type == "cpu" and not cpu_has_native_bf16():
            log.warning("%s, emulated (this CPU has no AVX512-BF16/AMX): slower than fp32; model.precision: auto or "
                        "fp32 is faster (and gives other numbers)", said)
        else:
            log.info(said)
    return precision


def native_bf16(device_type: str) -> bool:
    """Does this kind of device compute bf16 natively (the rule of `model.precision: auto`)?"""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and cpu_has_native_bf16()


def autocast(precision: str, device: torch.device):
    """The forward's precision context: bf16 / fp16 autocast (the loss then runs on fp32 casts); fp32: none."""
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES.get(precision, torch.bfloat16),
                          enabled=precision in AUTOCAST_DTYPES)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """open_clip_train's `amp`: a dynamic loss scale for fp16 gradients (skips a step whose gradients overflow and
    lowers the scale). Disabled (scale/unscale/step pass through unchanged) for fp32 and bf16."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def cpu_has_native_bf16() -> bool:
    # The CPU's own flags, not oneDNN's `_is_mkldnn_bf16_supported`: that is true on any AVX512 core, where oneDNN
    # emulates bf16 (a Cascade Lake without AVX512-BF16 says true and runs bf16 slower than fp32).
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
