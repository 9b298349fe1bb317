"""Several nodes, and dvc.lock right afterwards (docs/scale.md "Several nodes"): the upstream stages recorded by
`dvc commit`, one training stage run by hand as two "nodes" (two `torch.distributed.run --nnodes 2` launchers meeting
through c10d rendezvous on 127.0.0.1, gloo, one directory as their shared file system), then `dvc commit -f
train@clip`: `dvc status` is clean and `dvc repro train@clip` trains nothing again (it would re-train on one node).
On the fault suite's tiny project; minutes: tests/scale/ only."""
from __future__ import annotations

import subprocess

from faults.conftest import ENV, OUTPUTS, PREPARING, PY, run_stage, tiny_project  # noqa: F401  (session fixture)

from scale.test_train_ranks import data_meta, train_on_two_nodes

UPSTREAM = ["sample", *[f"{s}@{PREPARING[s]}" for s in ("word_regions", "sentences", "segments", "negatives",
                                                       "lism")], "pretrain", "shards", "code", "run_settings"]


def dvc(root, *args, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, "-m", "dvc", *args], cwd=root, env=ENV, capture_output=True, text=True, check=False)
    assert not check or proc.returncode == 0, f"dvc {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_a_stage_trained_on_two_nodes_is_committed_and_dvc_status_is_clean(tiny_project, tmp_path):  # noqa: F811
    data = [rel for rels in OUTPUTS.values() for rel in rels] + ["models/base", "dvclive/pretrain"]
    proj = tiny_project.clone(tmp_path / "nodes", data)
    run_stage(proj.root, "code")
    run_stage(proj.root, "run_settings")                       # data/runs/clip.json: what train@clip trains with
    dvc(proj.root, "commit", "-f", *UPSTREAM)                   # what `dvc repro <upstream>` would have recorded
    assert "train@clip" in dvc(proj.root, "status", "train@clip").stdout

    train_on_two_nodes(proj, "commit")
    assert data_meta(proj)["ranks"] == 2

    dvc(proj.root, "commit", "-f", "train@clip")                # the step docs/scale.md shows after the nodes
    status = dvc(proj.root, "status", *UPSTREAM, "train@clip")
    assert "up to date" in status.stdout, status.stdout
    again = dvc(proj.root, "repro", "train@clip")
    assert "Running stage" not in again.stdout, again.stdout[-3000:]
