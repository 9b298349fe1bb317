"""stages/_common.py's launcher: a model stage started as one plain process (as `dvc repro` starts it) re-runs itself
as its ranks through torch.distributed.run and exits with their code; an item stage takes every GPU the ranks may use,
a training stage the largest count that splits its global batch, a data stage one process; `compute.llm_gpus` keeps
the last visible GPUs out of the ranks' CUDA_VISIBLE_DEVICES; a process that is already a rank (torchrun's
RANK/WORLD_SIZE, srun's SLURM_NTASKS) joins as it is. subprocess and the visible GPUs are faked (no GPU needed)."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from stages import _common
from stages._common import ITEMS, StageParams, TrainingBatch, launch

from clipfinetune import compute

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "DVC_STAGE", "CUDA_VISIBLE_DEVICES")
LOG = logging.getLogger("test")


@pytest.fixture()
def calls(monkeypatch, tmp_path):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["stages/train.py", "--run", "clip", "--method", "clip"])
    monkeypatch.setattr(compute, "LOCK_DIR", tmp_path / "locks")
    made = []

    def fake_call(cmd, env=None, **_):
        made.append((cmd, env))
        return 7                                        # the ranks' exit code, passed on

    monkeypatch.setattr(subprocess, "call", fake_call)
    return made


def hardware(monkeypatch, gpus: int | list[str], **values) -> None:
    """`compute` = values; the GPUs this process sees = `gpus` (a count, or the ids CUDA_VISIBLE_DEVICES names)."""
    ids = [str(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    monkeypatch.setattr(_common, "compute_settings", lambda: compute.settings(values))
    monkeypatch.setattr(_common, "visible_gpus", lambda: list(ids))


def _params(stage="train@clip") -> StageParams:
    return StageParams(stage, {})


def launched(calls) -> tuple[int, str | None]:
    ((cmd, env),) = calls
    (nproc,) = [int(a.split("=")[1]) for a in cmd if a.startswith("--nproc_per_node=")]
    return nproc, env.get("CUDA_VISIBLE_DEVICES")


def test_a_plain_process_relaunches_itself_as_n_ranks_and_exits_with_their_code(calls, monkeypatch):
    hardware(monkeypatch, 0, device="cpu", nproc=2)
    with pytest.raises(SystemExit) as exit_:
        launch(_params("eval@clip"), ITEMS, LOG)
    assert exit_.value.code == 7
    ((cmd, env),) = calls
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd
    # the same script and argv, after "--" (else torch.distributed.run reads train.py's --run as its --run-path)
    assert cmd[-6:] == ["--", "stages/train.py", "--run", "clip", "--method", "clip"]
    assert env["DVC_STAGE"] == "eval@clip"              # every rank resolves the same stage
    assert "CUDA_VISIBLE_DEVICES" not in env            # gloo ranks on the CPU


@pytest.mark.parametrize("launcher_env",
                         [{"RANK": "0", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "16"}])
def test_a_process_that_is_already_a_rank_joins(calls, monkeypatch, launcher_env):
    hardware(monkeypatch, 0, device="cpu", nproc=2)
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    launch(_params(), ITEMS, LOG)
    assert calls == []


def test_a_single_task_sbatch_script_still_launches_its_ranks(calls, monkeypatch):
    """sbatch's batch step carries SLURM_PROCID=0 with one task: `dvc repro` there is not a rank yet."""
    hardware(monkeypatch, 0, device="cpu", nproc=2)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(SystemExit):
        launch(_params(), ITEMS, LOG)
    assert len(calls) == 1


def test_one_rank_and_a_data_stage_run_in_place(calls, monkeypatch):
    hardware(monkeypatch, 0, device="cpu", nproc=1)
    launch(_params(), ITEMS, LOG)
    hardware(monkeypatch, 8, nproc=2)
    launch(_params("shards"), None, LOG)                 # a data stage: one process whatever compute says
    assert calls == []


def test_an_item_stage_takes_every_gpu(calls, monkeypatch):
    hardware(monkeypatch, 8)
    with pytest.raises(SystemExit):
        launch(_params("segments@docci"), ITEMS, LOG)
    assert launched(calls) == (8, "0,1,2,3,4,5,6,7")


@pytest.mark.parametrize("batch, gpus, ranks", [(50, 8, 5), (256, 7, 4), (16, 7, 4), (50, 7, 5), (256, 8, 8)])
def test_training_takes_the_largest_count_that_splits_its_global_batch(calls, monkeypatch, batch, gpus, ranks):
    """HarmoCLIP's 50 on 8 GPUs: 5 ranks of 10; every paper's batch on 7 GPUs trains (no stop after the data)."""
    hardware(monkeypatch, gpus)
    with pytest.raises(SystemExit):
        launch(_params(), TrainingBatch(batch), LOG)
    assert launched(calls) == (ranks, ",".join(map(str, range(ranks))))
    assert batch % ranks == 0


def test_accumulation_counts_in_the_split(calls, monkeypatch):
    """With accum_steps 2 each rank's share must split in 2 micro-batches: 36 on 8 GPUs -> 6 ranks of 6 = 2 x 3
    (8 ranks would take 4.5 each, 4 ranks 9 = no 2 equal micro-batches)."""
    hardware(monkeypatch, 8)
    with pytest.raises(SystemExit):
        launch(_params(), TrainingBatch(36, 2), LOG)
    assert launched(calls)[0] == 6


def test_a_count_that_does_not_split_the_batch_stops_naming_the_param_and_values(calls, monkeypatch):
    hardware(monkeypatch, 8, train_nproc=8)
    with pytest.raises(SystemExit, match=r"train\.harmoclip\.batch_size 50 .*does not split.*"
                                         r"train\.harmoclip\.batch_size: 48, train\.harmoclip\.batch_size: 56.*"
                                         r"compute\.train_nproc: auto"):
        launch(_params("train@harmoclip"), TrainingBatch(50, 1, "train.harmoclip.batch_size"), LOG)
    assert calls == []


def test_llm_gpus_keeps_the_last_cards_out_of_the_ranks(calls, monkeypatch):
    """vLLM beside training: the server on the last visible card, the ranks on the others."""
    hardware(monkeypatch, 8, llm_gpus=1)
    with pytest.raises(SystemExit):
        launch(_params("lism@docci"), ITEMS, LOG)
    assert launched(calls) == (7, "0,1,2,3,4,5,6")
    calls.clear()
    hardware(monkeypatch, ["2", "3", "5"], llm_gpus=1)    # the user's own CUDA_VISIBLE_DEVICES=2,3,5
    with pytest.raises(SystemExit):
        launch(_params(), TrainingBatch(64), LOG)
    assert launched(calls) == (2, "2,3")


def test_no_gpu_left_for_the_ranks_stops(calls, monkeypatch):
    hardware(monkeypatch, 1, llm_gpus=1)
    with pytest.raises(SystemExit, match="compute.llm_gpus 1 keeps every one of the 1 visible GPUs"):
        launch(_params("eval@clip"), ITEMS, LOG)
    assert calls == []
