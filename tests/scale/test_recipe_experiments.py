"""The README's real-data path with two papers, on the miniature real tree (tests/fixtures/real_tree.py), in a
throw-away copy: `clipfinetune recipe A`, `dvc exp run -n A`; a sweep of A (`-S train.mulclip.lr=...`); `clipfinetune
recipe B`, `dvc exp run -n B`; then back to A. The papers sit side by side in `dvc exp show` and `dvc metrics diff`,
B overwrote nothing of A, and the return trains and evaluates nothing: DVC's run cache restores every stage of A
(no stage has a persisted output, which would keep it out of the run cache). Compute only is scaled down, as
tests/scale/test_real_profile_dag.py. Minutes on 2 CPU cores: `make test-scale`.
"""
from __future__ import annotations

import json
import re

import pytest
import yaml
from fixtures import real_tree
from fixtures.project import RAN, copy_project, write_params
from fixtures.project import run as _run

from scale.test_real_profile_dag import CPU, WEIGHTS

pytestmark = pytest.mark.dag

A, B = "mulclip", "harmoclip"         # two papers with their own data stages (sentences@docci / word_regions@coco)
SMALL = {"epochs": 1, "batch_size": 2, "warmup": 1}    # each paper's own optimiser group, scaled down


# each paper's own stand-in weights (as ViT-B-16 and EVA02-B-16 differ): the base, and so every stage, differs
# between the papers, and the return to A must restore A's stages, not find them untouched
PAPER_WEIGHTS = {A: WEIGHTS, B: WEIGHTS + "-b"}


def _recipe(repo, paper: str) -> str:
    out = _run(repo, "clipfinetune", "recipe", paper).stdout
    write_params(repo, {**CPU, "model": {"pretrained": f"local-dir:{PAPER_WEIGHTS[paper]}"},
                        "train": {**CPU["train"], "harmoclip": SMALL, "mulclip": SMALL}})
    return out


@pytest.fixture(scope="module")
def papers(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("papers") / "project")
    real_tree.build(repo)
    for seed, folder in enumerate(PAPER_WEIGHTS.values()):
        torch.manual_seed(seed)
        export_model(load_model("cft-tiny-vit"), repo / folder)
    _run(repo, "git", "init", "-q")
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project")
    rec = {"repo": repo, "ran": {}, "log": {}}
    for name, paper, sets in ((A, A, []), (f"{A}-lr", A, ["-S", "train.mulclip.lr=2e-5"]), (B, B, []),
                              (f"{A}-back", A, [])):
        rec["recipe_" + name] = _recipe(repo, paper)
        rec["dag_" + name] = set(_run(repo, "dvc", "stage", "list", "--name-only").stdout.split())
        proc = _run(repo, "dvc", "exp", "run", "-n", name, *sets)
        rec["ran"][name], rec["log"][name] = RAN.findall(proc.stdout), proc.stdout + proc.stderr
    rec["show"] = json.loads(_run(repo, "dvc", "exp", "show", "--json").stdout)
    rec["diff"] = json.loads(_run(repo, "dvc", "metrics", "diff", A, B, "--json").stdout)
    return rec


def test_each_paper_runs_its_own_stages_and_never_the_sample_world(papers):
    for name, paper in ((A, A), (B, B)):
        ran, dag = set(papers["ran"][name]), papers["dag_" + name]
        assert ran <= dag and dag - ran <= {"code"}, (name, sorted(ran ^ dag))    # the code did not change
        assert {s.split("@")[0] for s in ran} >= {"train", "eval", "pretrain", "shards"}
        assert not [s for s in dag if s.startswith("sample")]
        assert {s.split("@")[1] for s in ran if s.startswith("train@")} == set(
            yaml.safe_load((papers["repo"] / "recipes" / f"{paper}.yaml").read_text())["runs"])
    assert "sentences@docci" in papers["ran"][A] and "word_regions@coco" in papers["ran"][B]


def test_returning_to_a_paper_trains_and_evaluates_nothing_again(papers):
    """Run-cache restore: only the always-changed plan and benchmark listing and the report (an uncached output)
    run. Every stage of A changed since A ran (the sweep re-trained its runs, B re-made the base and the shards)."""
    assert {"train@mulclip", "train@mulclip_global_only"} <= set(papers["ran"][f"{A}-lr"])
    assert "train.mulclip.lr: 2e-05 -> (none)" in papers["recipe_" + B]     # the sweep's edit, named, not carried
    ran = set(papers["ran"][f"{A}-back"])
    assert ran <= {"plan@repro", "evalsets", "report"}, ran
    log = papers["log"][f"{A}-back"]
    for stage in ("pretrain", "shards", "train@mulclip", "train@mulclip_global_only", "eval@mulclip",
                  "eval@mulclip_global_only", "eval_base"):
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in log, (stage, log[-3000:])
    assert re.search(r"Stage 'sentences@docci' (is cached - skipping run|didn't change, skipping)", log)


def _experiments(show: list) -> dict[str, dict]:
    """exp name -> its metrics files, from `dvc exp show --json`."""
    out = {}
    for baseline in show:
        for exp in baseline.get("experiments") or []:
            for rev in exp.get("revs") or []:
                if rev.get("name"):
                    out[rev["name"]] = rev["data"]["metrics"]
    return out


def test_the_papers_sit_side_by_side_in_exp_show_and_metrics_diff(papers):
    exps = _experiments(papers["show"])
    assert {A, B, f"{A}-back"} <= set(exps)
    assert "metrics/mulclip.json" in exps[A] and "metrics/harmoclip.json" not in exps[A]
    assert "metrics/harmoclip.json" in exps[B] and "metrics/mulclip.json" not in exps[B]
    assert exps[f"{A}-back"]["metrics/mulclip.json"] == exps[A]["metrics/mulclip.json"]    # restored, not re-made
    diff = papers["diff"]
    assert "metrics/mulclip.json" in diff and "metrics/harmoclip.json" in diff     # each paper's rows, side by side
