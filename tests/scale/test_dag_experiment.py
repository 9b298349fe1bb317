"""The experiment flow on the tiny sample world (tests/test_dag.py runs the whole DAG; this adds an experiment): with
two runs (clip, fsc_clip), `dvc exp run -S runs.fsc_clip.lambda_l=0.2` re-runs exactly train@fsc_clip, eval@fsc_clip
and report, and `dvc metrics diff` between baseline and experiment changes only metrics/fsc_clip.json and
metrics/summary.json. Minutes on 2 cores: `make test-scale`."""
from __future__ import annotations

import json

import pytest
import yaml
from fixtures.project import RAN, TINY, copy_project, write_params
from fixtures.project import run as _run

pytestmark = pytest.mark.dag


def _git_commit(repo, msg: str) -> None:
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", msg)


def _lock(repo) -> dict:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


@pytest.fixture(scope="module")
def dag(tmp_path_factory):
    repo = copy_project(tmp_path_factory.mktemp("exp") / "project")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    write_params(repo, TINY)
    with open(repo / "params.yaml") as f:                  # two runs: the baseline and the swept one
        text = yaml.safe_load(f)
    text["runs"] = {"clip": params["runs"]["clip"], "fsc_clip": params["runs"]["fsc_clip"]}
    (repo / "params.yaml").write_text(yaml.safe_dump(text, sort_keys=False))
    _run(repo, "git", "init", "-q")
    _git_commit(repo, "tiny project")
    _run(repo, "dvc", "repro")
    _git_commit(repo, "baseline")
    rec = {"lock_baseline": _lock(repo)}
    exp = _run(repo, "dvc", "exp", "run", "-n", "l02", "-S", "runs.fsc_clip.lambda_l=0.2")
    rec["exp_ran"] = RAN.findall(exp.stdout)
    rec["lock_exp"] = _lock(repo)
    rec["metrics_diff"] = json.loads(_run(repo, "dvc", "metrics", "diff", "--json", "HEAD").stdout)
    rec["exp_diff"] = json.loads(_run(repo, "dvc", "exp", "diff", "--json", "HEAD", "l02").stdout)
    return rec


def test_exp_run_reruns_exactly_fsc_clip_its_eval_and_report(dag):
    wanted = {"train@fsc_clip", "eval@fsc_clip", "report"}
    assert set(dag["exp_ran"]) == wanted | {"benchmarks"}      # benchmarks re-lists (same output, lock unchanged)
    before, after = dag["lock_baseline"], dag["lock_exp"]
    assert before.keys() == after.keys()
    assert {name for name in before if before[name] != after[name]} == wanted
    assert after["train@fsc_clip"]["params"]["params.yaml"]["runs.fsc_clip"]["lambda_l"] == 0.2


def test_metrics_diff_changes_only_fsc_clip_and_summary(dag):
    files = {path for path, keys in dag["metrics_diff"].items() if keys}
    assert files <= {"metrics/fsc_clip.json", "metrics/summary.json"}
    assert "metrics/fsc_clip.json" in files
    summary_keys = dag["metrics_diff"].get("metrics/summary.json", {})
    assert all("fsc_clip" in key for key in summary_keys), sorted(summary_keys)
    exp_metrics = {path for path, keys in dag["exp_diff"]["metrics"].items() if keys}
    assert exp_metrics == files
    assert set(dag["exp_diff"]["params"]["params.yaml"]) == {"runs.fsc_clip.lambda_l"}
