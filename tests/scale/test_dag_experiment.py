"""The whole DAG with all 12 runs on the tiny sample world and the experiment flow (tests/test_dag.py runs five runs
in `make test`): every run trains and is evaluated, the report carries its 12 claims with CIs;
`dvc exp run -S loss.lambda_l=0.2` re-runs exactly run_settings, train@ and eval@ of the runs that use lambda_L
(fsc_clip and its ablation fsc_lhn_only; not fsc_global_only, which zeroes it, nor the mix, whose weights are its own
terms) and report, and `dvc metrics diff` between baseline and experiment changes only those models' metrics and
metrics/summary.json. Minutes on 2 cores: `make test-scale`."""
from __future__ import annotations

import json

import pytest
import yaml
from fixtures.project import RAN, TINY, assert_sweep_reran_exactly, copy_project, write_params
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
    write_params(repo, TINY)
    _run(repo, "git", "init", "-q")
    _git_commit(repo, "tiny project")
    stages = _run(repo, "dvc", "stage", "list", "--name-only").stdout.split()
    first = RAN.findall(_run(repo, "dvc", "repro").stdout)
    _git_commit(repo, "baseline")
    rec = {"repo": repo, "lock_baseline": _lock(repo), "stages": stages, "first_ran": first,
           "summary": json.loads((repo / "metrics" / "summary.json").read_text())}
    exp = _run(repo, "dvc", "exp", "run", "-n", "l02", "-S", "loss.lambda_l=0.2")
    rec["exp_ran"] = RAN.findall(exp.stdout)
    rec["lock_exp"] = _lock(repo)
    rec["metrics_diff"] = json.loads(_run(repo, "dvc", "metrics", "diff", "--json", "HEAD").stdout)
    rec["exp_diff"] = json.loads(_run(repo, "dvc", "exp", "diff", "--json", "HEAD", "l02").stdout)
    return rec


def test_every_run_trains_and_the_report_carries_its_12_claims(dag):
    assert sorted(dag["first_ran"]) == sorted(dag["stages"])
    # 12 fine-tuning runs (clip, 5 methods, 5 ablations, custom); 13 evaluated models (those + base)
    assert len([s for s in dag["stages"] if s.startswith("train@")]) == 12
    assert len([s for s in dag["stages"] if s.startswith("eval@")]) == 12 and "eval_base" in dag["stages"]
    summary = dag["summary"]
    assert summary["missing_models"] == [] and summary["missing_items"] == []
    claims = [c for cs in summary["claims"].values() for c in cs.values()]
    assert len(claims) == 12
    for c in claims:                      # every claim carries its CI and a verdict
        assert c["verdict"] in {"holds", "contradicted", "inconclusive", "saturated"}, c
        assert c["ci_low"] <= c["difference"] + 1e-9 and c["difference"] <= c["ci_high"] + 1e-9, c


LAMBDA_L_RUNS = ("fsc_clip", "fsc_lhn_only")


def test_exp_run_reruns_exactly_the_runs_that_use_lambda_l_their_evals_and_report(dag):
    assert_sweep_reran_exactly(dag, LAMBDA_L_RUNS)


def test_metrics_diff_changes_only_those_models_and_summary(dag):
    files = {path for path, keys in dag["metrics_diff"].items() if keys}
    assert files <= {f"metrics/{r}.json" for r in LAMBDA_L_RUNS} | {"metrics/summary.json"}
    assert "metrics/fsc_clip.json" in files
    summary_keys = dag["metrics_diff"].get("metrics/summary.json", {})
    assert all(any(r in key for r in LAMBDA_L_RUNS) for key in summary_keys), sorted(summary_keys)
    exp_metrics = {path for path, keys in dag["exp_diff"]["metrics"].items() if keys}
    assert exp_metrics == files
    assert set(dag["exp_diff"]["params"]["params.yaml"]) == {"loss.lambda_l"}


def test_the_mulclip_terms_probe_follows_every_step_of_the_run(dag):
    """research/mulclip_terms.py on the baseline's workspace: one record per optimiser step of train@mulclip, each
    with the three term groups' backbone gradients, cosines in [-1, 1] and a finite share of the global step."""
    from research import mulclip_terms

    repo = dag["repo"]
    data = json.loads((repo / "dvclive" / "train" / "mulclip" / "data.json").read_text())
    epochs = yaml.safe_load((repo / "params.yaml").read_text())["train"]["epochs"]
    res = mulclip_terms.main(["--root", str(repo)])
    assert res["steps"] == len(res["records"]) == data["steps"] == -(-epochs * data["units"] // data["global_batch"])
    for r in res["records"]:
        assert set(r["grad_norm"]) == {"global", "word", "sub"} and all(v > 0 for v in r["grad_norm"].values())
        assert all(-1 <= c <= 1 for c in r["cos_with_global"].values()) and 0 < r["global_kept"] < 10
