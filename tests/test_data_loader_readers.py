"""Shards per source and any ranks x workers: a method opens only the shards of the sources whose records it wants
(index.json), and the loader splits samples across readers when shards are fewer than ranks x workers."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from test_data_helpers import StubMethod
from test_data_loader import CTX, records, run, shards  # noqa: F401  (the module's shards fixture)

from clipfinetune.data.loader import ShardLoader, reader_shards, wanted_sources
from clipfinetune.methods.goal import GoalMethod
from clipfinetune.methods.mulclip import MulClipMethod


class LongCaptionStub(StubMethod):
    """Wants records by their fields (as GOAL does), never by source."""

    def wants(self, record):
        return bool(record.get("long_caption"))


@pytest.mark.parametrize("cls", [GoalMethod, MulClipMethod])
def test_goal_and_mulclip_read_only_docci_shards(shards, cls):  # noqa: F811
    method = types.SimpleNamespace(name=cls.__name__, wants=lambda r: cls.wants(None, r))
    assert wanted_sources(shards, "train", method) == ["docci"]


def test_a_long_caption_method_opens_only_docci_shards_and_sees_every_docci_sample(shards):  # noqa: F811
    docci = {k for k, r in records(shards, "train").items() if r["source"] == "docci"}
    index = json.loads((shards / "index.json").read_text())["train"]
    loader = ShardLoader(shards, "train", LongCaptionStub(), CTX, batch_size=2)
    assert sorted(Path(p).name for p in loader.paths) == sorted(index["docci"]["shards"])
    assert all(Path(p).name.startswith("train-docci-") for p in loader.paths)
    assert loader.num_samples == len(docci) and loader.stats["dropped_by_method"] == 0
    assert {k for s, _, _ in run(loader, 0) for k in s} == docci


def test_reader_shards_split_samples_when_shards_are_fewer_than_readers():
    order = ["a", "b", "c"]
    assert [reader_shards(order, r, 2) for r in range(2)] == [[("a", 0, 1), ("c", 0, 1)], [("b", 0, 1)]]
    shares = [reader_shards(order, r, 8) for r in range(8)]
    assert all(len(s) == 1 for s in shares)
    for shard in order:          # the readers of a shard take disjoint residues covering every position
        parts = sorted((p, n) for [(u, p, n)] in shares if u == shard)
        assert [p for p, _ in parts] == list(range(len(parts))) and {n for _, n in parts} == {len(parts)}


@pytest.mark.parametrize("workers", [0, 2])
def test_two_ranks_with_more_readers_than_shards_run_equal_epochs_over_every_sample(shards, workers):  # noqa: F811
    docci = {k for k, r in records(shards, "train").items() if r["source"] == "docci"}
    lengths, seen = set(), set()
    for rank in (0, 1):
        loader = ShardLoader(shards, "train", LongCaptionStub(), CTX, batch_size=2, seed=0, num_workers=workers,
                             rank=rank, world_size=2)
        if workers:
            assert len(loader.paths) < 2 * workers          # the case that used to be refused
        batches = run(loader, 0)
        lengths.add((len(loader), len(batches)))
        seen |= {k for s, _, _ in batches for k in s}
    w = max(1, workers)
    steps = -(-len(docci) // 4)                     # batches of 2 per rank, 2 ranks
    assert lengths == {(-(-steps // w) * w,) * 2}
    assert seen == docci


def test_a_method_epoch_reads_each_shard_once_and_visits_every_unit_once(shards, monkeypatch):  # noqa: F811
    from test_data_loader import CaptionUnitStub, unit_pairs

    import clipfinetune.data.loader as loader_module

    coco = {k: r for k, r in records(shards, "train").items() if r["source"] == "coco"}
    every = {(k, i) for k, r in coco.items() for i in range(len(r["captions"]))}
    batch_size = max(b for b in range(1, 9) if len(every) % b == 0)      # no fill batch: exactly one epoch
    opened = []
    real = loader_module._shard_samples
    monkeypatch.setattr(loader_module, "_shard_samples", lambda url: opened.append(url) or real(url))
    loader = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=batch_size, seed=3, epoch_unit="method")
    assert max(len(r["captions"]) for r in coco.values()) > 1 and len(loader.paths) > 1
    for epoch in (0, 1):
        opened.clear()
        pairs = unit_pairs(loader.batches(epoch))
        assert sorted(pairs) == sorted(every)                            # every (image, caption) exactly once
        assert sorted(opened) == sorted(loader.paths)                    # one read of each (coco) shard
