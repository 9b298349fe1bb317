"""The one device rule (clipfinetune.distributed.resolve_device / init_distributed) and the ranks param that
stages/_common.py start() reads (issue 32). CUDA is mocked: torch reports it present, set_device records."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clipfinetune import distributed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cuda_present(monkeypatch):
    set_to = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: set_to.append(torch.device(device)))
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_LOCALID", "MPI_LOCALRANKID",
                 "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    return set_to


def test_auto_and_cuda_take_cuda_local_rank_when_cuda_is_present(cuda_present):
    assert distributed.resolve_device("auto") == torch.device("cuda", 3)
    assert distributed.resolve_device(None) == torch.device("cuda", 3)
    assert distributed.resolve_device("cuda") == torch.device("cuda", 3)
    assert distributed.resolve_device("cpu") == torch.device("cpu")
    info = distributed.init_distributed("auto")
    assert (info.device, info.local_rank, info.world_size) == (torch.device("cuda", 3), 3, 1)
    assert cuda_present == [torch.device("cuda", 3)]


def test_without_cuda_auto_is_cpu_and_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.resolve_device("auto") == torch.device("cpu")
    assert distributed.init_distributed().device == torch.device("cpu")
    with pytest.raises(RuntimeError, match="no CUDA"):
        distributed.resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu, cuda"):
        distributed.resolve_device("gpu")


def test_ranks_of_an_item_stage(cuda_present, monkeypatch):
    """`compute.nproc` through stages/_common.py's launcher rule: auto = every visible GPU, 1 on the CPU."""
    from stages._common import ITEMS, stage_ranks, visible_gpus

    from clipfinetune.compute import ComputeError, settings

    gpus = visible_gpus()
    assert gpus == ["0", "1", "2", "3"]
    assert stage_ranks("eval@clip", ITEMS, settings({}), gpus)[0] == 4                          # every visible GPU
    assert stage_ranks("eval@clip", ITEMS, settings({"device": "cpu"}), gpus)[0] == 1           # CPU: one rank
    assert stage_ranks("eval@clip", ITEMS, settings({"device": "cpu", "nproc": 2}), gpus)[0] == 2   # 2 gloo ranks
    assert stage_ranks("shards", None, settings({"nproc": 2}), gpus)[0] == 1                   # not a model stage
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert visible_gpus() == []
    assert stage_ranks("eval@clip", ITEMS, settings({}), [])[0] == 1
    with pytest.raises(ComputeError, match="compute.nproc must be auto or an integer >= 1"):
        settings({"nproc": 0})


@pytest.mark.parametrize("stage_file", ["train.py", "pretrain.py"])
def test_training_stages_pass_compute_device_to_the_rule(stage_file):
    """pretrain and train hand `compute.device` to their training session, which hands it to init_distributed and
    records the device used (tests/test_train_session.py)."""
    text = (ROOT / "stages" / stage_file).read_text()
    assert "training_session(" in text and "compute_device()" in text
    session = (ROOT / "clipfinetune" / "train" / "session.py").read_text()
    assert "init_distributed(device)" in session and '"device": str(self.dist.device)' in session
