"""Per-rank part files (clipfinetune/parts.py): the split cannot depend on the number of ranks, parts round-trip
exactly, a killed run resumes from its parts, stale parts are never read."""
from __future__ import annotations

import logging

import pytest
import torch

from clipfinetune.parts import (
    PartStore,
    compute_parts,
    fingerprint,
    read_parts,
    run_sharded,
    units_of_rank,
    work_units,
)

LOG = logging.getLogger("test_parts")


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_every_unit_goes_to_exactly_one_rank_and_holds_the_same_items(world_size):
    items = [f"img{i:03d}" for i in range(23)]
    units = work_units(items, 4)
    assert [len(u) for u in units] == [4, 4, 4, 4, 4, 3]
    assert [i for u in units for i in u] == items
    taken = [k for rank in range(world_size) for k in units_of_rank(len(units), rank, world_size)]
    assert sorted(taken) == list(range(len(units)))
    counts = [len(units_of_rank(len(units), rank, world_size)) for rank in range(world_size)]
    assert max(counts) - min(counts) <= 1


@pytest.mark.parametrize("codec", ["json", "torch"])
def test_parts_round_trip_exactly_and_refuse_other_items(tmp_path, codec):
    store = PartStore(tmp_path, "eval@clip", "k1", codec)
    result = {"x": [0.1 + 0.2, 1 / 3, 1e-300]}
    if codec == "torch":
        result["emb"] = torch.randn(3, 5)
    store.write(0, ["a", "b"], result)
    back = store.read(0, ["a", "b"])
    assert back["x"] == [0.1 + 0.2, 1 / 3, 1e-300]
    if codec == "torch":
        assert torch.equal(back["emb"], result["emb"])
    with pytest.raises(RuntimeError, match="not the part of unit 0"):
        store.read(0, ["a", "c"])
    store.path(1).write_bytes(b"\x00half")
    with pytest.raises(RuntimeError, match="unreadable part file"):
        store.read(1, ["x"])


def test_stale_parts_of_another_fingerprint_are_deleted_never_read(tmp_path):
    old = PartStore(tmp_path, "lism", "old")
    old.write(0, ["a"], {"v": 1})
    new = PartStore(tmp_path, "lism", "new")
    assert not new.has(0)
    assert new.remove_stale() == ["old"]
    assert not old.dir.exists()


def test_a_killed_run_resumes_from_its_parts_and_ends_as_an_uninterrupted_one(tmp_path):
    items = [f"img{i}" for i in range(10)]
    units = work_units(items, 3)
    calls = []

    def compute(unit):
        calls.append(list(unit))
        if len(calls) == 3 and not resumed:
            raise KeyboardInterrupt        # the kill, after two parts were written
        return {"len": [len(i) * 0.1 for i in unit]}

    resumed = False
    store = PartStore(tmp_path / "a", "segments", "k")
    with pytest.raises(KeyboardInterrupt):
        compute_parts(store, units, str, compute, 0, 1, LOG, "segments")
    resumed, calls = True, []
    done = compute_parts(store, units, str, compute, 0, 1, LOG, "segments")
    assert done == {"units": 4, "resumed": 2} and calls == [units[2], units[3]]
    straight = PartStore(tmp_path / "b", "segments", "k")
    compute_parts(straight, units, str, compute, 0, 1, LOG, "segments")
    assert read_parts(store, units, str) == read_parts(straight, units, str)


def test_ranks_sharing_the_parts_give_rank_0_every_unit_in_order(tmp_path):
    items = list(range(11))
    units = work_units(items, 2)
    store = PartStore(tmp_path, "segments", "k")
    for rank in (1, 2):       # the other ranks of 3 (a no-op barrier: they ran before rank 0 here)
        assert run_sharded(store, units, str, lambda u: [x * x for x in u], rank, 3, lambda: None, LOG, "s") is None
    merged = run_sharded(store, units, str, lambda u: [x * x for x in u], 0, 3, lambda: None, LOG, "s")
    assert [x for part in merged for x in part] == [x * x for x in items]


def test_fingerprint_follows_settings_code_content_and_data_files(tmp_path):
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jpg").write_bytes(b"jpeg")
    key = lambda settings={"batch_size": 8}: fingerprint("lism", settings, ["code.py", "data"], tmp_path)
    first = key()
    assert key() == first
    assert key({"batch_size": 16}) != first
    (tmp_path / "code.py").write_text("x = 2\n")
    second = key()
    assert second != first
    (tmp_path / "data" / "a.jpg").write_bytes(b"jpeg, longer")
    assert key() != second
