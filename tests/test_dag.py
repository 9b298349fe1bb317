"""The whole DVC DAG end to end on a tiny sample world, in a throw-away git repo copy of the project, driven by the
user's three commands exactly as the README writes them: `dvc repro`, `dvc exp run -S loss.lambda_l=0.2`,
`dvc metrics diff`.

One module-scoped fixture runs them once (every stage, with four of the runs: clip, fsc_clip and its ablation
fsc_lhn_only, which inherits lambda_L, and the mix custom, whose fsc_clip term has its own weight, so `make test`
stays short;
tests/scale/test_dag_experiment.py runs all 12 with the report's claims); the tests read what it recorded (stage
`evalsets` is always changed: it re-lists the evaluation-set files on every repro, and its unchanged output re-runs
nothing):
  - a second `dvc repro` runs only `evalsets` and `dvc status` shows nothing else;
  - every run's dvclive curves render in `dvc plots show`;
  - `dvc exp run -S loss.lambda_l=0.2` re-runs exactly run_settings, train@ and eval@ of the runs that use lambda_L
    and report, and `dvc metrics diff` lists only those models' rows;
  - every model stage records the precision it ran in (`model.precision: auto`).
What an edit re-runs (an older params spelling, `train.seed`, a module, a loss file, a new method, a host's worker
counts): tests/scale/test_dag_experiment.py, on the 12-run DAG.
Run with `pytest -m dag` (several minutes on 2 CPU cores; see fixtures/project.py TINY for the profile).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from fixtures.project import RAN, TINY, assert_sweep_reran_exactly, copy_project, write_params
from fixtures.project import run as _run

from clipfinetune.eval.items import recompute

pytestmark = pytest.mark.dag


def _git_commit(repo: Path, msg: str) -> None:
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", msg)




def _lock(repo: Path) -> dict:
    return yaml.safe_load((repo / "dvc.lock").read_text())["stages"]


RUNS = ("clip", "fsc_clip", "fsc_lhn_only", "custom")
LAMBDA_L_RUNS = ("fsc_clip", "fsc_lhn_only")      # the runs of RUNS whose effective settings read loss.lambda_l
CARD = (("dvc", "repro"), ("dvc", "exp", "run", "-S", "loss.lambda_l=0.2"), ("dvc", "metrics", "diff"))


def set_runs(repo: Path, runs: dict) -> None:
    """params.yaml `runs` replaced whole (as a recipe does), comments kept."""
    from ruamel.yaml import YAML

    y = YAML()
    params = y.load((repo / "params.yaml").read_text())
    params["runs"] = runs
    with open(repo / "params.yaml", "w") as f:
        y.dump(params, f)




@pytest.fixture(scope="module")
def dag(tmp_path_factory):
    repo = copy_project(tmp_path_factory.mktemp("dag") / "project")
    write_params(repo, TINY)
    runs = yaml.safe_load((repo / "params.yaml").read_text())["runs"]
    set_runs(repo, {name: runs[name] for name in RUNS})
    _run(repo, "git", "init", "-q")
    _git_commit(repo, "tiny project")
    rec = {"repo": repo, "stages": _run(repo, "dvc", "stage", "list", "--name-only").stdout.split()}

    t0 = time.perf_counter()
    first = _run(repo, *CARD[0])                                          # the card's first command
    rec["repro_seconds"] = time.perf_counter() - t0
    rec["first_ran"] = RAN.findall(first.stdout)
    _git_commit(repo, "baseline")
    rec["lock_baseline"] = _lock(repo)

    rec["second_ran"] = RAN.findall(_run(repo, "dvc", "repro").stdout)
    rec["status_clean"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    rec["plots"] = json.loads(_run(repo, "dvc", "plots", "show", "--json").stdout)

    # the card's sweep and comparison, exactly as written
    t0 = time.perf_counter()
    rec["exp_ran"] = RAN.findall(_run(repo, *CARD[1]).stdout)
    rec["exp_seconds"] = time.perf_counter() - t0
    rec["lock_exp"] = _lock(repo)
    rec["metrics_diff"] = _run(repo, *CARD[2]).stdout

    print(f"\n[dag] exp run {rec['exp_seconds']:.0f}s")
    print(f"\n[dag] repro {rec['repro_seconds']:.0f}s")
    return rec


ALWAYS = {"evalsets": ["always changed"]}


def _changed(status: dict) -> dict:
    """`dvc status` without the always-changed `evalsets` stage."""
    assert status.get("evalsets") == ALWAYS["evalsets"], status
    return {k: v for k, v in status.items() if k != "evalsets"}


def test_repro_runs_every_stage_and_writes_every_metric(dag):
    assert sorted(dag["first_ran"]) == sorted(dag["stages"])
    assert sorted(s for s in dag["stages"] if s.startswith("train@")) == sorted(f"train@{r}" for r in RUNS)
    assert len([s for s in dag["stages"] if s.startswith("eval@")]) == len(RUNS) and "eval_base" in dag["stages"]
    eval_models = ["base"] + [s.split("@", 1)[1] for s in dag["stages"] if s.startswith("eval@")]
    for model in eval_models:
        metrics = json.loads((dag["repo"] / "metrics" / f"{model}.json").read_text())
        assert metrics["meta"]["model"] == model
        items = pd.read_parquet(dag["repo"] / "metrics" / "items" / f"{model}.parquet")
        assert recompute(items[items["benchmark"] == "retrieval.sample"], "retrieval.sample.i2t_r1") \
            == pytest.approx(metrics["retrieval"]["sample"]["i2t_r1"])
    summary = json.loads((dag["repo"] / "metrics" / "summary.json").read_text())
    assert summary["missing_items"] == []
    claims = [c for cs in summary["claims"].values() for c in cs.values()]
    present = [c for c in claims if c["verdict"] != "missing"]     # a claim on a run left out here is "missing"
    assert present and len(claims) == 12  # all 12 with their CIs: tests/scale/test_dag_experiment.py
    for c in present:                      # every claim carries its CI and a verdict
        assert c["verdict"] in {"holds", "contradicted", "inconclusive", "saturated"}, c
        assert c["ci_low"] <= c["difference"] + 1e-9 and c["difference"] <= c["ci_high"] + 1e-9, c
    assert "95% CI" in (dag["repo"] / "reports" / "summary.md").read_text()


def test_second_repro_is_a_no_op_and_status_is_clean(dag):
    assert dag["second_ran"] == ["evalsets"]          # re-listed; its output unchanged, so no eval re-ran
    assert dag["status_clean"] == ALWAYS


def test_every_runs_curves_render_in_plots_show(dag):
    """The curves are each train@<run>'s `plots` output (dvc.yaml names no run): every run's total loss renders."""
    assert not dag["plots"].get("errors"), dag["plots"]["errors"]
    runs = [s.split("@", 1)[1] for s in dag["stages"] if s.startswith("train@")]
    for run in runs + ["pretrain"]:
        prefix = f"dvclive/train/{run}" if run != "pretrain" else "dvclive/pretrain"
        (rendered,) = dag["plots"]["data"][f"{prefix}/plots/metrics/loss.tsv"]
        values = rendered["content"]["data"]["values"]
        assert values and {"step", "loss"} <= set(values[0]), run


def test_exp_run_of_loss_lambda_l_reruns_exactly_the_runs_that_use_it_their_evals_and_report(dag):
    """`dvc exp run -S loss.lambda_l=0.2`: fsc_clip and fsc_lhn_only (its ablation inherits lambda_L) re-train; clip
    and the mix (whose weights are its own terms) do not."""
    assert_sweep_reran_exactly(dag, LAMBDA_L_RUNS)


def _diff_rows(text: str) -> list[tuple[str, str]]:
    """(path, metric) of each row of `dvc metrics diff`'s table."""
    return [tuple(line.split()[:2]) for line in text.splitlines() if line.startswith("metrics/")]


def test_metrics_diff_lists_only_the_rerun_models_rows(dag):
    rows = _diff_rows(dag["metrics_diff"])
    paths = {path for path, _ in rows}
    assert paths <= {f"metrics/{r}.json" for r in LAMBDA_L_RUNS} | {"metrics/summary.json"}, dag["metrics_diff"]
    assert "metrics/fsc_clip.json" in paths
    summary = [metric for path, metric in rows if path == "metrics/summary.json"]
    assert all(any(run in metric for run in LAMBDA_L_RUNS) for metric in summary), summary














def _cpu_has_native_bf16() -> bool:
    """From the kernel's CPU flags (not through torch, which the code under test asks)."""
    flags = Path("/proc/cpuinfo").read_text().split()
    return "avx512_bf16" in flags or "amx_tile" in flags


def test_every_model_stage_records_the_precision_it_ran_in(dag):
    """`model.precision: auto`: bf16 on a CPU with native bf16, fp32 otherwise; evaluation always fp32."""
    trained = "bf16" if _cpu_has_native_bf16() else "fp32"
    repo = dag["repo"]
    assert json.loads((repo / "dvclive" / "pretrain" / "device.json").read_text())["precision"] == trained
    for run in RUNS:
        assert json.loads((repo / "dvclive" / "train" / run / "data.json").read_text())["precision"] == trained, run
    for model in ("base", *RUNS):
        assert json.loads((repo / "metrics" / f"{model}.json").read_text())["meta"]["precision"] == "fp32", model
    assert json.loads((repo / "data" / "prepared" / "local_pairs.meta.json").read_text())["precision"] == "fp32"
