"""The whole DAG under `dvc repro` with `compute.nproc: 2` (issue 32): every model stage re-launches itself as 2
gloo ranks on the CPU, with no dvc.yaml edit, and computes what one rank computes.

On the tiny world (tests/fixtures/project.py TINY) restricted to two runs (clip; goal, which reads segments and
LISM's pairs), in a throw-away copy of the project:
  1. `dvc repro` of the model stages' targets at `compute.nproc: 2`: pretrain, train@clip, train@goal, segments,
     lism, eval_base, eval@clip, eval@goal all run, each as 2 ranks (train/pretrain: their recorded `ranks`; the
     item stages: every rank's "rank R computed" log line, as their outputs carry no rank count, so that they can
     equal a 1-rank run's byte for byte);
  2. `dvc status` after `compute.nproc: 1` lists none of them (compute is no stage's DVC param); the same stages
     forced again at `compute.nproc: 1` (`dvc repro -s -f`, on the models the 2-rank run trained,
     so that both see the same inputs): segments, lism and eval outputs byte-identical; train@<run> takes the same
     steps and learning rates with a loss within tests/scale/test_train_ranks.py's LOSS_RTOL; pretrain (its
     batch_size global too) the same steps.
Several minutes on 2 CPU cores: tests/scale/ only.
"""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from fixtures.project import RAN, TINY, copy_project, run, write_params
from ruamel.yaml import YAML

from scale.test_train_ranks import LOSS_RTOL

RUNS = {"clip": {"method": "clip"}, "goal": {"method": "goal"}}
TRAIN = [f"train@{r}" for r in RUNS]
EVALS = ["eval_base"] + [f"eval@{r}" for r in RUNS]
ITEM_STAGES = ["segments@docci", "lism@docci", *EVALS]       # a data stage runs once per source
MODEL_STAGES = ["pretrain", *TRAIN, *ITEM_STAGES]
ITEM_OUTPUTS = {
    "segments@docci": ["data/prepared/segments.parquet", "data/prepared/segments.meta.json"],
    "lism@docci": ["data/prepared/local_pairs.parquet", "data/prepared/local_pairs.meta.json",
                   "data/evalsets/global_local", "metrics/lism.json"],
    **{stage: [f"metrics/{m}.json", f"metrics/items/{m}.parquet"]
       for stage, m in zip(EVALS, ["base", *RUNS], strict=True)},
}


def set_params(repo: Path, runs: dict | None = None, **overlay) -> None:
    if overlay:
        write_params(repo, overlay)
    if runs is not None:                               # `runs` is replaced whole (as a recipe does), not merged
        y = YAML()
        params = y.load((repo / "params.yaml").read_text())
        params["runs"] = runs
        with open(repo / "params.yaml", "w") as f:
            y.dump(params, f)


def snapshot(repo: Path, rels: list[str]) -> dict[str, bytes]:
    out = {}
    for rel in rels:
        path = repo / rel
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        out.update({str(p.relative_to(repo)): p.read_bytes() for p in files})
    return out


def curve(live: Path, name: str) -> dict[int, float]:
    with open(live / "plots" / "metrics" / f"{name}.tsv") as f:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(f, delimiter="\t")}


def live_dir(repo: Path, stage: str) -> Path:
    return repo / "dvclive" / ("pretrain" if stage == "pretrain" else f"train/{stage.split('@', 1)[1]}")


def ranks_logged(log: str, stage: str) -> set[int]:
    """The ranks that logged their share of an item stage (clipfinetune/parts.py run_sharded)."""
    return {int(r) for r in re.findall(rf"\[{re.escape(stage)}\] .*?: rank (\d+) computed", log)}


@pytest.fixture(scope="module")
def dag(tmp_path_factory):
    repo = copy_project(tmp_path_factory.mktemp("dag_ranks") / "project")
    write_params(repo, TINY)
    set_params(repo, runs=RUNS, compute={"nproc": 2})
    run(repo, "git", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tiny, 2 runs")
    two = run(repo, "dvc", "repro", *MODEL_STAGES)
    rec = {"repo": repo, "ran": RAN.findall(two.stdout), "log": two.stdout + two.stderr,
           "outputs2": snapshot(repo, [r for rels in ITEM_OUTPUTS.values() for r in rels]),
           "meta2": {s: json.loads((live_dir(repo, s) / ("device.json" if s == "pretrain" else "data.json"))
                                   .read_text()) for s in ["pretrain", *TRAIN]},
           "curves2": {s: {n: curve(live_dir(repo, s), n) for n in ("loss", "lr")} for s in ["pretrain", *TRAIN]}}

    set_params(repo, compute={"nproc": 1})
    rec["status_after"] = json.loads(run(repo, "dvc", "status", "--json", *MODEL_STAGES).stdout or "{}")
    # the item stages first, on the models the 2-rank run trained; then the training stages (pretrain last: train@
    # reads its model)
    one = run(repo, "dvc", "repro", "-s", "-f", *ITEM_STAGES, *TRAIN, "pretrain")
    rec["log1"] = one.stdout + one.stderr
    rec["outputs1"] = snapshot(repo, [r for rels in ITEM_OUTPUTS.values() for r in rels])
    rec["meta1"] = {s: json.loads((live_dir(repo, s) / ("device.json" if s == "pretrain" else "data.json"))
                                  .read_text()) for s in ["pretrain", *TRAIN]}
    rec["curves1"] = {s: {n: curve(live_dir(repo, s), n) for n in ("loss", "lr")} for s in ["pretrain", *TRAIN]}
    return rec


def test_every_model_stage_runs_as_two_ranks(dag):
    assert set(MODEL_STAGES) <= set(dag["ran"]), dag["ran"]
    for stage in ["pretrain", *TRAIN]:
        assert dag["meta2"][stage]["ranks"] == 2, stage
        assert dag["meta1"][stage]["ranks"] == 1, stage
    for stage in ITEM_STAGES:
        assert ranks_logged(dag["log"], stage) == {0, 1}, (stage, dag["log"][-3000:])
        assert ranks_logged(dag["log1"], stage) == {0}, stage


def test_a_new_rank_count_leaves_every_stage_up_to_date(dag):
    """compute is the hardware, no stage's DVC param: after the 2-rank run, nproc 1 re-runs nothing."""
    assert dag["status_after"] == {}


def test_item_stage_outputs_equal_one_ranks_byte_for_byte(dag):
    two, one = dag["outputs2"], dag["outputs1"]
    assert two.keys() == one.keys()
    for stage, rels in ITEM_OUTPUTS.items():
        assert any(k.startswith(tuple(rels)) for k in two), stage
    assert [k for k in two if two[k] != one[k]] == []


def test_training_takes_the_same_steps_with_a_close_loss(dag):
    for stage in TRAIN:
        m1, m2 = dag["meta1"][stage], dag["meta2"][stage]
        assert m1["global_batch"] == m2["global_batch"] == 2 * m2["rank_batch"], stage
        assert m1["batches_per_epoch"] == m2["batches_per_epoch"], stage
        c1, c2 = dag["curves1"][stage], dag["curves2"][stage]
        assert c1["lr"] == c2["lr"] and len(c1["lr"]) >= 2, stage
        assert c1["loss"].keys() == c2["loss"].keys(), stage
        for step, value in c1["loss"].items():
            assert abs(c2["loss"][step] - value) <= LOSS_RTOL * abs(value), (stage, step, value, c2["loss"][step])


def test_pretrain_batch_is_global_too(dag):
    """pretrain.batch_size is split across the ranks (stages/pretrain.py): the same steps and schedule."""
    m1, m2 = dag["meta1"]["pretrain"], dag["meta2"]["pretrain"]
    assert m1["global_batch"] == m2["global_batch"] == 2 * m2["rank_batch"] == m1["rank_batch"]
    c1, c2 = dag["curves1"]["pretrain"], dag["curves2"]["pretrain"]
    assert c1["lr"] == c2["lr"] and len(c1["lr"]) >= 2
