"""clipfinetune/compute.py: the rank rules of params `compute` and the GPU locks of concurrent stages on one host;
and interface 3 of DEVELOPERS.md: no stage declares `compute` (the hardware) as a DVC param."""
from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from clipfinetune import compute
from clipfinetune.compute import ComputeError, settings, training_ranks

ROOT = Path(__file__).resolve().parents[1]


def test_settings_fill_defaults_and_refuse_unknown_or_bad_values():
    assert settings(None) == compute.DEFAULTS
    with pytest.raises(ComputeError, match="unknown keys") as e:
        settings({"gpus": 2})
    assert e.value.param == "compute.gpus"
    for key, bad in (("device", "gpu"), ("nproc", 0), ("train_nproc", True), ("llm_gpus", -1)):
        with pytest.raises(ComputeError) as e:
            settings({key: bad})
        assert e.value.param == f"compute.{key}" and e.value.fixes


@pytest.mark.parametrize("batch, most, nodes, accum, expected", [
    (50, 8, 1, 1, 5), (256, 7, 1, 1, 4), (16, 7, 1, 1, 4), (64, 8, 1, 1, 8), (7, 8, 1, 1, 7), (13, 8, 1, 1, 1),
    (256, 8, 2, 1, 8), (48, 8, 2, 2, 6), (50, 8, 2, 1, 5)])
def test_auto_takes_the_largest_count_that_splits_the_batch(batch, most, nodes, accum, expected):
    k = training_ranks(settings({}), batch, most, nodes, accum)
    assert k == expected
    assert batch % (k * nodes * accum) == 0
    assert all(batch % (j * nodes * accum) for j in range(k + 1, most + 1))     # none larger splits it


def test_a_batch_no_node_count_splits_is_refused_with_batches_that_split():
    with pytest.raises(ComputeError, match=r"train.batch_size 50 .* 4 node\(s\)") as e:
        training_ranks(settings({}), 50, 8, nodes=4)
    assert e.value.param == "train.batch_size"
    fixes = [int(f.split(": ")[1]) for f in e.value.fixes if f.startswith("train.batch_size")]
    assert fixes == [32, 64] and all(b % 32 == 0 for b in fixes)


def test_an_explicit_count_must_split_the_batch_and_fit_the_gpus():
    assert training_ranks(settings({"train_nproc": 2}), 50, 8) == 2
    with pytest.raises(ComputeError) as e:
        training_ranks(settings({"train_nproc": 8}), 50, 8, param="train.harmoclip.batch_size")
    assert e.value.param == "train.harmoclip.batch_size"
    assert "train.harmoclip.batch_size: 48" in e.value.fixes and "train.harmoclip.batch_size: 56" in e.value.fixes
    assert "compute.train_nproc: 5" in e.value.fixes and "compute.train_nproc: 8" not in e.value.fixes
    with pytest.raises(ComputeError, match="more than the 4 rank"):
        training_ranks(settings({"train_nproc": 8}), 64, 4)


def test_item_ranks_and_the_llm_split():
    s = settings({"llm_gpus": 1})
    gpus = compute.rank_gpus(s, [str(i) for i in range(8)])
    assert gpus == [str(i) for i in range(7)]
    assert compute.item_ranks(s, len(gpus), True) == 7
    assert compute.item_ranks(settings({"nproc": 3}), 7, True) == 3
    with pytest.raises(ComputeError, match="compute.nproc 9 is more than the 7"):
        compute.item_ranks(settings({"nproc": 9}), 7, True)
    assert compute.item_ranks(settings({"nproc": 4}), 0, False) == 4          # gloo ranks on the CPU
    assert compute.rank_gpus(settings({"llm_gpus": 1}), []) == []             # no GPU: nothing to keep


def test_a_stage_waits_for_the_gpus_another_stage_holds(tmp_path):
    """Two queued experiments on one host: the second's GPU stage waits until the first releases the card."""
    order, waited, waiting = [], [], threading.Event()

    def first():
        with compute.gpu_locks(["0", "1"], lock_dir=tmp_path):
            order.append("first in")
            waiting.wait(30)                   # until the second stage reports it waits (or a time-out: the test fails)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    while not order:
        time.sleep(0.01)
    with compute.gpu_locks(["1", "2"], on_wait=lambda gpu: (waited.append(gpu), waiting.set()), lock_dir=tmp_path):
        order.append("second in")
    t.join()
    assert order == ["first in", "first out", "second in"] and waited == ["1"]
    with compute.gpu_locks(["3"], on_wait=waited.append, lock_dir=tmp_path):   # a free card: no wait
        pass
    assert waited == ["1"]


def test_no_stage_declares_compute():
    """Interface 3: the hardware is no DVC param, so a change of GPUs or ranks re-runs no stage (the committed
    dvc.yaml, every stage and foreach body)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    bodies = {name: body.get("do", body) for name, body in stages.items()}
    declared = {name: [p for p in body.get("params", []) if isinstance(p, str) and p.split(".")[0] == "compute"]
                for name, body in bodies.items()}
    assert {k: v for k, v in declared.items() if v} == {}
    committed = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout
    assert "compute" in yaml.safe_load(committed)                               # still the user's knob
