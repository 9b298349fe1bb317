"""Training as several ranks (issue 32), on the fault suite's tiny project, gloo ranks on the CPU.

(a) `compute.nproc: 2` makes `stages/train.py`, started as a plain process (as `dvc repro` starts it), re-run itself
    as 2 ranks through torch.distributed.run; with `train.batch_size` the GLOBAL batch it takes the same steps,
    the same learning-rate schedule and a loss curve close to a 1-rank run's (tolerance below).
(b) two "nodes": two `torch.distributed.run --nnodes 2` processes meeting through c10d rendezvous on 127.0.0.1
    (docs/scale.md "Several nodes") train the same run.
Minutes each (the tiny project's data stages, then several training processes): tests/scale/ only."""
from __future__ import annotations

import csv
import json
import socket
import subprocess

from faults.conftest import ENV, PY, Project, run_stage, tiny_project  # noqa: F401  (the session fixture)

TRAIN_INPUTS = ["data/shards", "models/base"]
STAGE, CMD = "train@clip", ["stages/train.py", "--run", "clip", "--method", "clip", "--stage", "train@clip"]
METRICS = "dvclive/train/clip/plots/metrics"
# Each rank takes its slice of the same global batch (data/loader.py), so the 2-rank run computes the 1-rank run's
# steps up to the order of float reductions (the gradient all-reduce, the gathered features): the losses agree to
# float precision, far inside this tolerance. A rank-count bug in the batch (other samples per step, or each rank
# taking the global batch: ln 8 instead of ln 4 near chance) moves them by percent, and a wrong step count or
# schedule fails the exact checks.
LOSS_RTOL = 1e-3


def curve(proj: Project, name: str) -> dict[int, float]:
    with open(proj / METRICS / f"{name}.tsv") as f:
        return {int(row["step"]): float(row[name]) for row in csv.DictReader(f, delimiter="\t")}


def data_meta(proj: Project) -> dict:
    return json.loads((proj / "dvclive/train/clip/data.json").read_text())


def one_rank_run(tiny: Project, dest) -> Project:
    proj = tiny.clone(dest, TRAIN_INPUTS)
    run_stage(proj.root, STAGE, timeout=600)
    assert data_meta(proj)["ranks"] == 1
    return proj


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_two_nodes(proj: Project, rdzv_id: str) -> None:
    """train@clip by two `torch.distributed.run --nnodes 2` launchers meeting through c10d rendezvous on 127.0.0.1
    (one node rank each, one process per node), in `proj` (their shared file system); both must succeed."""
    port = free_port()
    nodes = [subprocess.Popen([PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, "--", *CMD],
                              cwd=proj.root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n\n".join(log[-3000:] for log in logs)


def test_two_ranks_started_by_the_stage_match_one_rank(tiny_project, tmp_path):  # noqa: F811
    one = one_rank_run(tiny_project, tmp_path / "one")
    two = tiny_project.clone(tmp_path / "two", TRAIN_INPUTS)
    two.set_params(compute={"nproc": 2})
    out = run_stage(two.root, STAGE, timeout=600)                 # a plain process: the stage launches the ranks
    meta1, meta2 = data_meta(one), data_meta(two)
    assert meta2["ranks"] == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert meta2["global_batch"] == meta1["global_batch"] == 2 * meta2["rank_batch"]
    assert meta2["batches_per_epoch"] == meta1["batches_per_epoch"]
    assert curve(two, "lr") == curve(one, "lr")                   # same steps, same schedule, exactly
    loss1, loss2 = curve(one, "loss"), curve(two, "loss")
    assert loss1.keys() == loss2.keys() and len(loss1) >= 2
    for step, value in loss1.items():
        assert abs(loss2[step] - value) <= LOSS_RTOL * abs(value), (step, value, loss2[step])
    assert (two / "models/clip/open_clip_model.safetensors").is_file()


def test_two_nodes_meet_through_c10d_rendezvous_and_train(tiny_project, tmp_path):  # noqa: F811
    one = one_rank_run(tiny_project, tmp_path / "one")
    proj = tiny_project.clone(tmp_path / "nodes", TRAIN_INPUTS)   # one directory: the nodes' shared file system
    run_stage(proj.root, "run_settings")                          # data/runs/clip.json, as DVC runs it first
    train_on_two_nodes(proj, "tiny")
    meta = data_meta(proj)
    assert meta["ranks"] == 2 and meta["rank_batch"] * 2 == meta["global_batch"]
    assert curve(proj, "lr") == curve(one, "lr")
    assert (proj / "models/clip/open_clip_model.safetensors").is_file()
