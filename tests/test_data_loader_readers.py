"""Any ranks x workers: every unit of an epoch exactly once across all readers, the same global batches at any rank
count, the sibling rule, `epoch_coverage` at the real configuration's size, and the shard index as the loader's
input (a method opens only the sources whose records it wants; a missing or broken index is a clear error)."""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest
from test_data_helpers import StubMethod
from test_data_loader import CTX, CaptionUnitStub, records, run, shards, unit_pairs  # noqa: F401  (module fixture)

from clipfinetune.data.loader import (
    Schedule,
    ShardLoader,
    coverage,
    epoch_coverage,
    positions_read,
    wanted_sources,
)
from clipfinetune.io import InputError
from clipfinetune.methods.goal import GoalMethod
from clipfinetune.methods.mulclip import MulClipMethod

# COCO train2017's captions (docs/scale.md): 118,287 images, 591,753 captions
COCO_IMAGES, COCO_CAPTIONS = 118_287, 591_753


class LongCaptionStub(StubMethod):
    """Wants records by their fields (as GOAL does), never by source."""

    def wants(self, record):
        return bool(record.get("long_caption"))


def coco_like_units() -> np.ndarray:
    """The record of each unit of a COCO-sized caption epoch: 5 captions per image, a 6th and 7th for some."""
    per_image = np.full(COCO_IMAGES, 5)
    extra = COCO_CAPTIONS - per_image.sum()
    per_image[:extra // 2] += 1
    per_image[:extra - extra // 2] += 1
    assert per_image.sum() == COCO_CAPTIONS
    return np.repeat(np.arange(COCO_IMAGES), per_image)


@pytest.mark.parametrize(("ranks", "workers", "global_batch"), [(8, 8, 256), (2, 8, 50), (7, 1, 49)])
def test_every_unit_once_per_epoch_at_8x8_readers_over_a_real_size_index(ranks, workers, global_batch):
    """params.real.yaml's batch 256 at 8 GPUs x 8 workers (4.0% unseen and 4.4% repeated when readers took whole
    shards), HarmoCLIP's 50 at 2 x 8, and 7 ranks: the partition reads every stream position once, so each pass
    (epoch) is every unit exactly once, and a run of E epochs is ceil(E N / G) steps."""
    unit_records = coco_like_units()
    n = len(unit_records)
    schedule = Schedule(n, global_batch // ranks, ranks, 1, seed=0, unit_records=unit_records)
    positions = np.sort(positions_read(schedule, workers, epochs=2))
    steps = -(-2 * n // global_batch)
    assert np.array_equal(positions, np.arange(steps * global_batch))       # no position twice, none skipped
    for epoch in (0, 1):
        units = schedule.units_at(np.arange(epoch * n, (epoch + 1) * n))
        assert np.array_equal(np.sort(units), np.arange(n))                 # the pass: every unit exactly once
    assert {schedule.epoch_length(e) for e in range(5)} <= {n // global_batch, -(-n // global_batch)}
    assert sum(schedule.epoch_length(e) for e in range(5)) == -(-5 * n // global_batch)
    cov = coverage(schedule, workers, epochs=2)
    assert (cov["units"], cov["seen"], cov["repeated"]) == (n, n, 0)
    assert cov["extra"] == steps * global_batch - 2 * n < global_batch and cov["steps"] == steps


def test_the_global_batch_keeps_sibling_captions_apart_across_epoch_boundaries():
    unit_records = coco_like_units()[:60_000]
    schedule = Schedule(len(unit_records), 32, 8, 1, seed=4, unit_records=unit_records)
    g = schedule.global_batch
    stream = np.concatenate([schedule.order(0), schedule.order(1), schedule.order(2)])
    recs = unit_records[stream]
    for k in range(len(stream) // g):                          # batches shared by two passes included
        batch = recs[k * g:(k + 1) * g]
        assert len(np.unique(batch)) == g, k


@pytest.mark.parametrize(("ranks", "workers"), [(1, 0), (2, 2), (3, 2)])
def test_ranks_and_workers_read_every_caption_once_per_epoch(shards, ranks, workers):  # noqa: F811
    """End to end over real tiny shards: rank r's micro-batch k holds stream positions k*B*R + r*B ... (module
    docstring); put back in stream order, the first pass is every (image, caption) of the index exactly once."""
    coco = {k: r for k, r in records(shards, "train").items() if r["source"] == "coco"}
    every = sorted((k, i) for k, r in coco.items() for i in range(len(r["captions"])))
    batch = 2
    stream: dict[int, tuple] = {}
    for rank in range(ranks):
        loader = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=batch, seed=1, num_workers=workers,
                             epoch_unit="method", rank=rank, world_size=ranks)
        assert loader.epoch_length(0) == -(-len(every) // (batch * ranks))
        for k, b in enumerate(loader.batches(0)):
            for j, pair in enumerate(unit_pairs([b])):
                stream[k * batch * ranks + rank * batch + j] = pair
    assert sorted(stream) == list(range(len(stream)))
    assert sorted(stream[p] for p in range(len(every))) == every


def test_the_global_batches_do_not_depend_on_ranks_or_workers(shards):  # noqa: F811
    """1 rank x 0 workers and 2 ranks x 2 workers, global batch 4: the same units in every global step."""
    one = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=2, epoch_unit="method")
    two = [ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=2, seed=2, num_workers=2,
                       epoch_unit="method", rank=r, world_size=2) for r in (0, 1)]
    for epoch in (0, 1):
        single = [sorted(unit_pairs([b])) for b in one.batches(epoch)]
        split = [sorted(unit_pairs([a]) + unit_pairs([b])) for a, b in zip(two[0].batches(epoch),
                                                                              two[1].batches(epoch))]
        assert single == split and len(single) == one.epoch_length(epoch)


def test_siblings_stay_apart_and_resume_is_exact_at_two_ranks(shards):  # noqa: F811
    loaders = [ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=2, seed=0, num_workers=2,
                           epoch_unit="method", rank=r, world_size=2) for r in (0, 1)]
    for epoch in (0, 1, 2):
        steps = [unit_pairs([a]) + unit_pairs([b]) for a, b in zip(*(lo.batches(epoch) for lo in loaders))]
        assert all(len({key for key, _ in step}) == 4 for step in steps)        # no two captions of one image
    full = unit_pairs(loaders[1].batches(1))
    for k in (1, 3):
        fresh = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=2, seed=0, num_workers=2,
                            epoch_unit="method", rank=1, world_size=2)
        assert unit_pairs(fresh.batches(1, start=k)) == full[2 * k:]


def test_epoch_coverage_says_what_the_loader_reads(shards):  # noqa: F811
    loader = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=3, seed=0, epoch_unit="method")
    cov = epoch_coverage(shards, "train", CaptionUnitStub(), global_batch=3, world_size=1, num_workers=2,
                         epoch_unit="method", epochs=3)
    assert cov["unit"] == "caption" and cov["units"] == loader.num_units
    assert cov["steps"] == sum(loader.epoch_length(e) for e in range(3))
    assert cov["steps_per_epoch"] == max(loader.epoch_length(e) for e in range(3))
    assert (cov["seen"], cov["repeated"]) == (loader.num_units, 0)
    sample = epoch_coverage(shards, "train", CaptionUnitStub(), global_batch=4, world_size=2, num_workers=3,
                            epoch_unit="method", epoch_samples=10, accum_steps=2)
    assert (sample["units"], sample["seen"], sample["steps"], sample["extra"]) == (10, 10, 3, 2)   # 3 x 4 = 10 + 2
    with pytest.raises(ValueError, match="does not split"):
        epoch_coverage(shards, "train", CaptionUnitStub(), global_batch=6, world_size=4, num_workers=0)


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
    assert loader.num_samples == len(docci) and loader.dropped_by_method == 0
    assert {k for s, _, _ in run(loader, 0) for k in s} == docci


def test_a_missing_or_broken_index_is_an_error_naming_the_file(shards, tmp_path):  # noqa: F811
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    index = copy / "index.json"
    good = index.read_text()
    index.unlink()
    with pytest.raises(InputError, match="missing.*dvc repro shards") as err:
        ShardLoader(copy, "train", StubMethod(), CTX, batch_size=2)
    assert str(index) in str(err.value)
    index.write_text(good[:len(good) // 2])                                    # a half-written file
    with pytest.raises(InputError, match="unreadable shard index") as err:
        ShardLoader(copy, "train", StubMethod(), CTX, batch_size=2)
    assert str(index) in str(err.value)
    old = json.loads(good)
    for entry in old["train"].values():
        del entry["records"]                                                   # an index without record tables
    index.write_text(json.dumps(old))
    with pytest.raises(InputError, match="record table") as err:
        ShardLoader(copy, "train", StubMethod(), CTX, batch_size=2)
    assert str(index) in str(err.value) and "train/coco" in str(err.value)
    index.write_text(good)
    shard = copy / json.loads(good)["train"]["coco"]["shards"][-1]
    shard.write_bytes(shard.read_bytes()[:2048])                               # the index and the tars disagree
    with pytest.raises(InputError, match="shorter than") as err:
        ShardLoader(copy, "train", StubMethod(), CTX, batch_size=2)
    assert str(shard) in str(err.value)


def test_validation_ranks_read_every_record_once(shards):  # noqa: F811
    keys = []
    for rank in range(3):
        loader = ShardLoader(shards, "val", StubMethod(), CTX, batch_size=2, train=False, num_workers=2, rank=rank,
                             world_size=3)
        batches = run(loader, 0)
        assert len(batches) == loader.epoch_length(0)
        keys += [k for s, _, _ in batches for k in s]
    assert sorted(keys) == sorted(records(shards, "val"))
