"""A change of the rank count re-runs nothing: `compute` is no stage's DVC param (interface 3), so after
`compute.nproc` changes `dvc status` lists no segments, lism, eval or train stage, while a param they do declare
still makes them stale. dvc.lock comes from `dvc commit` over stand-in files (the stages' real outputs would take
minutes; tests/scale/test_dag_ranks.py checks the same after real 2-rank runs)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from fixtures.project import copy_project, run, write_params

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"clip": {"method": "clip"}, "goal": {"method": "goal"}}
STAGES = ["segments@docci", "lism@docci", "eval_base", "eval@clip", "eval@goal", "train@clip", "train@goal"]


def stale(repo: Path) -> set[str]:
    """The stages `dvc status` lists as changed (its JSON: stage name -> what changed)."""
    import json

    out = run(repo, "dvc", "status", "--json", *STAGES).stdout
    return set(json.loads(out or "{}"))


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    from dvc.repo import Repo

    repo = copy_project(tmp_path_factory.mktemp("ranks") / "project")
    (repo / "params.yaml").write_text(subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=ROOT, check=True,
                                                     capture_output=True, text=True).stdout)
    write_params(repo, {"compute": {"nproc": 2}})
    from ruamel.yaml import YAML

    y = YAML()
    params = y.load((repo / "params.yaml").read_text())
    params["runs"] = RUNS
    with open(repo / "params.yaml", "w") as f:
        y.dump(params, f)
    run(repo, "git", "init", "-q")
    with Repo(str(repo)) as r:                           # stand-ins for every data dep and output of the stages
        for stage in r.index.stages:
            if stage.name not in STAGES:
                continue
            for entry in [*stage.deps, *stage.outs]:
                path = Path(entry.fs_path)
                if path.exists() or entry.def_path == "params.yaml":
                    continue
                if path.suffix:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(f"{entry.def_path}\n")
                else:
                    path.mkdir(parents=True)
                    (path / "part").write_text(f"{entry.def_path}\n")
    run(repo, "dvc", "commit", "-f", *STAGES)
    return repo


def test_a_new_rank_count_leaves_every_rank_independent_stage_up_to_date(locked):
    assert stale(locked) == set()
    write_params(locked, {"compute": {"nproc": 8, "train_nproc": 4, "device": "cuda", "llm_gpus": 1}})
    assert stale(locked) == set()


def test_a_param_the_stage_declares_still_reruns_it(locked):
    write_params(locked, {"lism": {"batch_size": 7}})
    assert stale(locked) == {"lism@docci"}
