"""All ranks must agree on the run's fingerprint (clipfinetune/train/checkpoint.py check_ranks_agree): two gloo
ranks on CPU, one with a different dep hash (a node with other code or data) -> every rank stops with an error
naming both fingerprints; equal ones pass."""
from __future__ import annotations

import json
import os

import torch.distributed as td
import torch.multiprocessing as mp

from clipfinetune.distributed import DistInfo
from clipfinetune.train.checkpoint import CheckpointError, check_ranks_agree, fingerprint


def _rank(rank: int, init: str, out: str, differ: bool) -> None:
    td.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    inputs = {"data/shards": "3f2a.dir", "clipfinetune/losses/clip.py": "9c1e" if rank == 0 or not differ else "0d0d"}
    fp = fingerprint("train@clip", {"lr": 1e-4}, inputs, world_size=2)
    try:
        check_ranks_agree(fp, DistInfo(rank=rank, world_size=2))
        result = {"ok": True}
    except CheckpointError as e:
        result = {"ok": False, "error": str(e)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    td.destroy_process_group()


def _run(tmp_path, differ: bool) -> list[dict]:
    out = tmp_path / ("differ" if differ else "same")
    out.mkdir()
    mp.start_processes(_rank, args=(str(out / "init"), str(out), differ), nprocs=2, join=True, start_method="fork")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_ranks_with_other_inputs_stop_with_both_fingerprints(tmp_path):
    assert _run(tmp_path, differ=False) == [{"ok": True}, {"ok": True}]
    results = _run(tmp_path, differ=True)
    assert [r["ok"] for r in results] == [False, False]
    assert all("rank 0" in r["error"] and "rank 1" in r["error"] for r in results)
