"""Device and DDP set-up from torchrun's environment (open_clip's `distributed.py`, without horovod): the one device
rule of every model stage (training, and the item stages segments / lism / eval, which import this module alone, so
an edit of the training loop does not re-run them).

`torchrun --nproc_per_node N stages/train.py ...` sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT;
a plain `python` run is rank 0 of 1. Backend: nccl on CUDA, gloo on CPU. On CUDA each process takes
`cuda:<LOCAL_RANK>`. SLURM / MPI variables are read as fall-backs for the rank numbers (as open_clip), but the
rendezvous is always `env://`, so MASTER_ADDR/MASTER_PORT must be set. Multi-node resume needs the checkpoint
directory on a shared file system (every rank reads the same file).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _env_int(*names: str, default: int) -> int:
    for name in names:
        if name in os.environ:
            return int(os.environ[name])
    return default


def world_info_from_env() -> tuple[int, int, int]:
    local_rank = _env_int("LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
    rank = _env_int("RANK", "PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", default=0)
    world_size = _env_int("WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", default=1)
    return local_rank, rank, world_size


DEVICE_SETTINGS = ("auto", "cpu", "cuda")


def resolve_device(setting: str | None = "auto") -> torch.device:
    """The one device rule of every model stage: "auto" (or None) = cuda:LOCAL_RANK when CUDA is available, else
    the CPU; "cpu"; "cuda" = cuda:LOCAL_RANK, an error when CUDA is absent."""
    setting = "auto" if setting is None else setting
    if setting not in DEVICE_SETTINGS:
        raise ValueError(f"compute.device must be one of {', '.join(DEVICE_SETTINGS)}, got {setting!r}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("compute.device is 'cuda' but torch reports no CUDA device "
                           "(set compute.device: auto or cpu, or install a CUDA build of torch)")
    local_rank, _, _ = world_info_from_env()
    return torch.device(f"cuda:{local_rank}")


def init_distributed(device: str | None = "auto") -> DistInfo:
    """The device by `resolve_device(device)`, and the process group when WORLD_SIZE > 1 (nccl on CUDA, gloo on
    the CPU)."""
    local_rank, rank, world_size = world_info_from_env()
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", init_method="env://",
                                rank=rank, world_size=world_size)
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world_size, device=dev)


def current() -> DistInfo:
    """The running process's DistInfo without initialising anything (CPU unless a group on CUDA is up)."""
    if dist.is_available() and dist.is_initialized():
        local_rank, _, _ = world_info_from_env()
        cuda = dist.get_backend() == "nccl"
        return DistInfo(dist.get_rank(), local_rank, dist.get_world_size(),
                        torch.device(f"cuda:{local_rank}") if cuda else torch.device("cpu"))
    return DistInfo()


def wrap_ddp(module: nn.Module, info: DistInfo, find_unused_parameters: bool = False) -> nn.Module:
    """DDP around the method's module (whose forward(batch) runs the model, so DDP's hooks fire); identity
    with one process."""
    if not info.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[info.device] if info.device.type == "cuda" else None,
                                   find_unused_parameters=find_unused_parameters)


def all_gather_objects(obj) -> list:
    """Every rank's `obj` (rank order); `[obj]` with one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.clone()
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def cleanup() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
