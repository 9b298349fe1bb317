"""What the item stages (segments, lism, eval) share: their device and ranks, and their per-rank part files.

`compute.device` (auto | cpu | cuda; params.yaml's hardware group, which no stage declares: stages/_common.py) goes
through the one device rule (`clipfinetune.distributed`): under torchrun each rank takes `cuda:LOCAL_RANK` when CUDA
is used, else the CPU. A stage is started as every GPU's rank (`_common.start(..., ranks=ITEMS)`). The items are split
into fixed work units across the ranks; parts live under data/cache/<stage>/<fingerprint>/ (`clipfinetune.parts`),
outside DVC's outputs, so a killed run resumes from them; rank 0 merges them and writes the outputs.
"""
from __future__ import annotations

from pathlib import Path

from stages import _common

from clipfinetune import parts

CACHE_ROOT = "data/cache"        # relative to the working directory (the project root); a shared FS across nodes


def setup_device(params):
    """DistInfo (rank, world_size, local_rank, device) from `compute.device` (read by `_common.compute_settings`,
    not a declared param: the outputs do not depend on it) and torchrun's environment."""
    from clipfinetune.distributed import init_distributed

    return init_distributed(_common.compute_device())


def part_store(params, settings: dict, device, codec: str = "json") -> parts.PartStore:
    """The stage's parts, keyed by a fingerprint of `settings` (what it computes with), the device TYPE (the same on
    every rank: cuda:0 and cuda:1 share one key), on the CPU torch's thread count, and its dvc.yaml deps."""
    import torch

    device_type = device.type if hasattr(device, "type") else str(device).split(":")[0]
    # on the CPU a kernel's float bits can follow the intra-op thread count: a resume at another count recomputes
    threads = torch.get_num_threads() if device_type == "cpu" else None
    inputs = _common.stage_inputs(params.stage)
    key = parts.fingerprint(params.stage, {**settings, "device": device_type, "torch_threads": threads}, inputs,
                            _common.ROOT)
    return parts.PartStore(Path(CACHE_ROOT), params.stage, key, codec)     # beside the outputs (relative, like OUT)


def run_sharded(store, units, ids_of, compute, dist, log, what: str, stream: bool = False):
    """`clipfinetune.parts.run_sharded` with the process group's barrier; rank 0 gets every unit's result."""
    from clipfinetune.distributed import barrier

    return parts.run_sharded(store, units, ids_of, compute, dist.rank, dist.world_size, barrier, log, what, stream)


def finish(dist) -> None:
    from clipfinetune.distributed import cleanup

    cleanup()
