"""A sweep through DVC's experiment queue on the real-data profile: the miniature real tree lives outside the
project, reached through the `datasets` link as docs/real-data.md "Reproducing the papers" sets it up, committed so
that each queued experiment's own workspace (.dvc/tmp/exps/...) has it too. The baseline runs `dvc repro eval@clip`;
a queued `-S train.lr=...` experiment then re-runs exactly train@clip and eval@clip (and `plan@repro` and
`evalsets`, always; the data stages, the negatives and their answer cache untouched: they are up to date from the
committed dvc.lock) and records its metrics.
Minutes on 2 cores: `make test-scale`."""
from __future__ import annotations

import json
import time

import pytest
from fixtures import real_tree
from fixtures.llm import openai_server, rewrite_reply
from fixtures.project import copy_project, write_params
from fixtures.project import run as _run

from scale.test_real_profile_dag import CPU, WEIGHTS


def _commit(repo, msg):
    _run(repo, "git", "add", "-A")
    _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", msg)


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    root = tmp_path_factory.mktemp("queue")
    repo = copy_project(root / "project")
    real_tree.build(root / "disk")                             # the data disk: root/disk/datasets/...
    (repo / "datasets").symlink_to(root / "disk" / "datasets", target_is_directory=True)
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    with openai_server(rewrite_reply(real_tree.NOUNS, real_tree.ADJECTIVES)) as (base_url, received):
        _run(repo, "python", "-m", "clipfinetune.project.profile", "apply", "params.real.yaml")
        write_params(repo, {**CPU, "negatives": {**CPU["negatives"], "base_url": base_url}})
        _run(repo, "git", "init", "-q")
        _commit(repo, "real-data profile")                  # the `datasets` link is committed (README)
        _run(repo, "dvc", "repro", "eval@clip")
        _commit(repo, "baseline")
        asked = len(received)
        _run(repo, "dvc", "exp", "run", "--queue", "-n", "lr2", "-S", "train.lr=2e-5", "eval@clip")
        _run(repo, "dvc", "queue", "start")
        t0 = time.perf_counter()
        while any(w in line.split() for line in _run(repo, "dvc", "queue", "status").stdout.splitlines()[1:]
                  for w in ("Queued", "Running")):
            assert time.perf_counter() - t0 < 900, "the queued experiment did not finish in 15 min"
            time.sleep(2)
        logs = _run(repo, "dvc", "queue", "logs", "lr2", check=False).stdout
        return {"repo": repo, "logs": logs, "asked_in_exp": len(received) - asked,
                "status": _run(repo, "dvc", "queue", "status").stdout,
                "show": json.loads(_run(repo, "dvc", "exp", "show", "--json").stdout)}


def test_the_queued_experiment_succeeds_and_reruns_only_training_and_its_eval(swept):
    assert "Success" in swept["status"], swept["status"] + swept["logs"][-3000:]
    ran = set(__import__("re").findall(r"Running stage '([^']+)'", swept["logs"]))
    # plan@repro and evalsets: always run; run_settings: re-resolves the runs (train.lr changed)
    assert ran == {"plan@repro", "evalsets", "run_settings", "train@clip", "eval@clip"}, swept["logs"][-3000:]
    assert swept["asked_in_exp"] == 0                      # negatives up to date: no LLM request, no lost cache


def test_the_experiments_metrics_are_recorded(swept):
    text = json.dumps(swept["show"])
    assert "lr2" in text and "metrics/clip.json" in text
