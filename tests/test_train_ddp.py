"""DDP on CPU (gloo, 2 processes through the torchrun environment variables) gives the gradients of one process on
the concatenated batch, for the in-batch contrastive loss (features gathered with gradients)."""
from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp
from test_train_support import TinyClipModel, ToySource, config, fixed_batch

from clipfinetune.methods.clip import ClipMethod
from clipfinetune.train import Trainer, cleanup, init_distributed

WORLD, LOCAL_BATCH = 2, 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_gradients(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    info = init_distributed(device="cpu")
    try:
        assert info.world_size == WORLD and torch.distributed.get_backend() == "gloo"
        trainer = Trainer(ClipMethod(), TinyClipModel(seed=0), ToySource(), config(batch_size=LOCAL_BATCH), dist=info)
        assert isinstance(trainer.ddp, torch.nn.parallel.DistributedDataParallel)
        batch = fixed_batch(WORLD * LOCAL_BATCH)
        mine = {k: v[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for k, v in batch.items()}
        trainer.compute_gradients([mine])
        grads = {n: p.grad for n, p in trainer.module.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        cleanup()


def test_ddp_gradients_equal_one_process_on_the_concatenated_batch(tmp_path):
    # fork: the children reuse the imported torch/open_clip (spawn would re-import them, ~10 s on a busy CPU)
    mp.start_processes(_rank_gradients, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="fork")
    single = Trainer(ClipMethod(), TinyClipModel(seed=0), ToySource(), config(batch_size=WORLD * LOCAL_BATCH))
    single.compute_gradients([fixed_batch(WORLD * LOCAL_BATCH)])
    expected = {n: p.grad for n, p in single.module.named_parameters()}
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got.keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")
