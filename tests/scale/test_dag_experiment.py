"""The whole DAG with all 12 runs on the tiny sample world and the experiment flow (tests/test_dag.py runs five runs
in `make test`): every run trains and is evaluated, the report carries its 12 claims with CIs;
`dvc exp run -S loss.lambda_l=0.2` re-runs exactly run_settings, train@ and eval@ of the runs that use lambda_L
(fsc_clip and its ablation fsc_lhn_only; not fsc_global_only, which zeroes it, nor the mix, whose weights are its own
terms) and report, and `dvc metrics diff` between baseline and experiment changes only those models' metrics and
metrics/summary.json. Before the sweep, on the baseline, what each edit re-runs: the older spelling
`runs.fsc_clip.lambda_l` re-trains fsc_clip alone; `train.seed` marks every train@ and not pretrain; editing a module
marks stage `code`, then only the stages that import it; editing DeGLA's loss file marks only the runs that load
DeGLA's loss; a host's worker and thread counts (environment) re-run nothing, the older params keys only the resolver.
After it, adding a method (its modules, loss weight and run) marks no existing train@ or eval@. Minutes on 2 cores:
`make test-scale`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fixtures.project import RAN, TINY, assert_sweep_reran_exactly, copy_project, write_params
from fixtures.project import env as project_env
from fixtures.project import run as _run

from clipfinetune import host

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
    runs = yaml.safe_load((repo / "params.yaml").read_text())["runs"]
    rec["degla_trains"] = [f"train@{r}" for r, spec in runs.items()            # the runs that load DeGLA's loss
                           if spec["method"] == "degla" or any(t.startswith("degla.") for t in spec.get("terms", {}))]

    # a run's settings reach train@<run> through data/runs/<run>.json (stage run_settings): dvc status shows the
    # resolver first, and after it exactly the runs whose file changed. Every edit is undone by writing the file's
    # bytes back: `git checkout` after a `dvc repro` (which autostages, rewriting the git index) was seen to leave a
    # same-size edit (seed 0 -> 7) in place
    params = repo / "params.yaml"
    baseline = params.read_bytes()
    write_params(repo, {"runs": {"fsc_clip": {"lambda_l": 0.2}}})        # the older spelling, by hand
    rec["status_old_spelling"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    _run(repo, "dvc", "repro", "run_settings")
    rec["status_old_spelling_resolved"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    params.write_bytes(baseline)
    write_params(repo, {"train": {"seed": 7}})
    _run(repo, "dvc", "repro", "run_settings")
    rec["status_seed"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    params.write_bytes(baseline)
    _run(repo, "dvc", "repro", "run_settings")                             # the baseline's settings files again
    llm = repo / "clipfinetune" / "data" / "negatives" / "degla" / "llm.py"   # a module only `negatives` imports
    code = llm.read_bytes()
    llm.write_bytes(code + b"# edited\n")
    rec["status_llm_edit"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    _run(repo, "dvc", "repro", "code")
    rec["status_llm_edit_digests"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    llm.write_bytes(code)
    _run(repo, "dvc", "repro", "code")
    loss = repo / "clipfinetune" / "losses" / "degla.py"                   # one method's loss file
    code = loss.read_bytes()
    loss.write_bytes(code + b"# edited\n")
    rec["status_loss_edit"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    rec["loss_edit_ran"] = RAN.findall(_run(repo, "dvc", "repro", "code").stdout)
    rec["status_loss_edit_digests"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    _run(repo, "dvc", "repro", "run_settings")
    rec["status_loss_edit_runs"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    loss.write_bytes(code)
    _run(repo, "dvc", "repro", "code", "run_settings")                     # the baseline's digests again
    rec["status_restored"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)

    # the host's worker and thread counts (clipfinetune/host.py), set as a host sets them and as an older params.yaml
    # still does: nothing re-runs, and the older keys re-run only the resolver, whose files stay the same
    counts = {name: "1" if "THREADS" in name else "3" for name in host.VARIABLES.values()}
    rec["status_host_counts"] = json.loads(_run_env(repo, counts, "dvc", "status", "--json").stdout)
    rec["host_counts_ran"] = RAN.findall(_run_env(repo, counts, "dvc", "repro").stdout)
    write_params(repo, {"train": {"workers": 5, "clip": {"workers": 1}}, "eval": {"workers": 3, "threads": 2},
                        "lism": {"workers": 3}})
    rec["status_old_counts"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    rec["old_counts_ran"] = RAN.findall(_run(repo, "dvc", "repro").stdout)
    params.write_bytes(baseline)
    _run(repo, "dvc", "repro", "run_settings")

    exp = _run(repo, "dvc", "exp", "run", "-n", "l02", "-S", "loss.lambda_l=0.2")
    rec["exp_ran"] = RAN.findall(exp.stdout)
    rec["lock_exp"] = _lock(repo)
    rec["metrics_diff"] = json.loads(_run(repo, "dvc", "metrics", "diff", "--json", "HEAD").stdout)
    rec["exp_diff"] = json.loads(_run(repo, "dvc", "exp", "diff", "--json", "HEAD", "l02").stdout)

    # research/mulclip_terms.py on this workspace, before a method the checkout's registry does not know is added
    from research import mulclip_terms

    rec["mulclip_probe"] = mulclip_terms.main(["--root", str(repo)])
    rec["mulclip_train"] = json.loads((repo / "dvclive" / "train" / "mulclip" / "data.json").read_text())
    rec["epochs"] = yaml.safe_load((repo / "params.yaml").read_text())["train"]["epochs"]

    # a new method, as DEVELOPERS.md adds one: its two modules, its loss weight, its run; nothing else is edited
    add_throwaway_method(repo)
    rec["status_new_method"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
    rec["new_method_ran"] = RAN.findall(_run(repo, "dvc", "repro", "code", "run_settings").stdout)
    rec["status_new_method_resolved"] = json.loads(_run(repo, "dvc", "status", "--json").stdout)
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
    """research/mulclip_terms.py on the workspace after the sweep (which leaves train@mulclip as it was), run by the
    fixture before it adds a method this checkout does not know: one record per optimiser step of train@mulclip, each
    with the three term groups' backbone gradients, cosines in [-1, 1] and a finite share of the global step."""
    data, epochs, res = dag["mulclip_train"], dag["epochs"], dag["mulclip_probe"]
    assert res["steps"] == len(res["records"]) == data["steps"] == -(-epochs * data["units"] // data["global_batch"])
    for r in res["records"]:
        assert set(r["grad_norm"]) == {"global", "word", "sub"} and all(v > 0 for v in r["grad_norm"].values())
        assert all(-1 <= c <= 1 for c in r["cos_with_global"].values()) and 0 < r["global_kept"] < 10


ALWAYS = {"evalsets": ["always changed"]}


def _changed(status: dict) -> dict:
    """`dvc status` without the always-changed `evalsets` stage."""
    assert status.get("evalsets") == ALWAYS["evalsets"], status
    return {k: v for k, v in status.items() if k != "evalsets"}


def add_throwaway_method(repo: Path) -> None:
    """methods/throwaway.py + losses/throwaway.py (plain CLIP under another name, with a weight of its own), its
    `loss` key and its run `runs.throwaway: {method: throwaway}`."""
    package = repo / "clipfinetune"
    (package / "losses" / "throwaway.py").write_text("from .clip import *  # noqa: F403\n")
    (package / "methods" / "throwaway.py").write_text(
        "from clipfinetune.losses import throwaway  # noqa: F401\n\nfrom .clip import ClipMethod\n\n\n"
        "class ThrowawayMethod(ClipMethod):\n    name = \"throwaway\"\n\n"
        "    def __init__(self, lambda_throwaway: float = 1.0):\n        super().__init__()\n")
    write_params(repo, {"loss": {"lambda_throwaway": 0.5}, "runs": {"throwaway": {"method": "throwaway"}}})


def _run_env(repo: Path, extra: dict, *cmd: str):
    """`cmd` in `repo` with `extra` in its environment (the stages' environment under `dvc repro`)."""
    import subprocess

    proc = subprocess.run(cmd, cwd=repo, env={**project_env(), **extra}, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_the_older_spelling_of_one_runs_weight_retrains_that_run_alone(dag):
    # before the resolver runs: it (params loss/runs/train) and report (params runs) are stale, no train@ yet
    assert set(_changed(dag["status_old_spelling"])) == {"run_settings", "report"}
    assert set(_changed(dag["status_old_spelling_resolved"])) == {"train@fsc_clip", "report"}


def test_editing_a_module_marks_only_the_stages_that_import_it(dag):
    """Code digests are import closures (clipfinetune/project/deps.py): an edit marks stage `code`, which rewrites
    the digests; DeGLA's LLM client is then `negatives`' alone."""
    assert list(_changed(dag["status_llm_edit"])) == ["code"]
    assert list(_changed(dag["status_llm_edit_digests"])) == ["negatives@coco"]


def test_editing_one_methods_loss_marks_only_its_runs(dag):
    """A method's code reaches train@<run> through data/code/methods/<method>.json (stage code), copied by
    run_settings into the file of every run that loads the method: editing DeGLA's loss file re-trains the DeGLA run
    and its ablation and the mix, whose terms name DeGLA's, and no other."""
    assert list(_changed(dag["status_loss_edit"])) == ["code"]
    assert dag["loss_edit_ran"] == ["code"]
    assert set(_changed(dag["status_loss_edit_digests"])) == {"run_settings"}
    assert set(_changed(dag["status_loss_edit_runs"])) == set(dag["degla_trains"])
    assert _changed(dag["status_restored"]) == {}


def test_a_new_method_retrains_nothing_that_exists(dag):
    """Adding methods/<m>.py + losses/<m>.py + its `loss` key and run: before the generated files are rewritten only
    the digest and settings stages, the report (params `runs`) and the new run's stages are stale; after them, the
    new run's stages and the report. No existing train@ or eval@ is ever marked."""
    new = {"train@throwaway", "eval@throwaway", "report"}
    assert set(_changed(dag["status_new_method"])) == new | {"code", "run_settings"}
    assert dag["new_method_ran"] == ["code", "run_settings"]
    assert set(_changed(dag["status_new_method_resolved"])) == new


def test_changing_train_seed_marks_every_run_and_not_pretrain(dag):
    # after the resolver: every run's settings file changed; downstream of the runs their eval@ stages and report
    # (not eval_base); sample, data stages, pretrain untouched
    assert set(_changed(dag["status_seed"])) == {s for s in dag["stages"] if s.startswith("train@")}


def test_a_hosts_worker_and_thread_counts_re_run_no_stage(dag):
    """Set per host (environment, clipfinetune/host.py), every count changed re-runs nothing; the older params keys
    (`train.workers`, `eval.workers`/`threads`, `lism.workers`) re-run the resolver alone (it declares `train` whole),
    whose unchanged settings files re-train nothing."""
    assert _changed(dag["status_host_counts"]) == {}
    assert dag["host_counts_ran"] == ["evalsets"]
    assert set(_changed(dag["status_old_counts"])) == {"run_settings"}
    assert sorted(dag["old_counts_ran"]) == ["evalsets", "run_settings"]
