"""stages/_common.py's launcher: a stage started as one plain process (as `dvc repro` starts it) with
`compute.nproc` N > 1 re-runs itself as N ranks through torch.distributed.run and exits with its code; a process
that is already a rank (torchrun's RANK/WORLD_SIZE, srun's SLURM_PROCID) joins as it is. subprocess is mocked."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
from _common import StageParams, relaunch_as_ranks

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "DVC_STAGE")


@pytest.fixture()
def calls(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["stages/train.py", "--run", "clip", "--method", "clip"])
    made = []

    def fake_call(cmd, env=None, **_):
        made.append((cmd, env))
        return 7                                        # the ranks' exit code, passed on

    monkeypatch.setattr(subprocess, "call", fake_call)
    return made


def _params(nproc) -> StageParams:
    return StageParams("train@clip", {"compute": {"device": "cpu", "nproc": nproc}})


def test_a_plain_process_relaunches_itself_as_n_ranks_and_exits_with_their_code(calls):
    with pytest.raises(SystemExit) as exit_:
        relaunch_as_ranks(_params(2))
    assert exit_.value.code == 7
    ((cmd, env),) = calls
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd
    # the same script and argv, after "--" (else torch.distributed.run reads train.py's --run as its --run-path)
    assert cmd[-6:] == ["--", "stages/train.py", "--run", "clip", "--method", "clip"]
    assert env["DVC_STAGE"] == "train@clip"             # every rank resolves the same stage


@pytest.mark.parametrize("launcher_env", [{"RANK": "0", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "16"}])
def test_a_process_that_is_already_a_rank_joins(calls, monkeypatch, launcher_env):
    for name, value in launcher_env.items():
        monkeypatch.setenv(name, value)
    relaunch_as_ranks(_params(2))
    assert calls == []


def test_a_single_task_sbatch_script_still_launches_its_ranks(calls, monkeypatch):
    """sbatch's batch step carries SLURM_PROCID=0 with one task: `dvc repro` there is not a rank yet."""
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    with pytest.raises(SystemExit):
        relaunch_as_ranks(_params(2))
    assert len(calls) == 1


def test_one_rank_runs_in_place(calls):
    relaunch_as_ranks(_params(1))
    assert calls == []
