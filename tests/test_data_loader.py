"""The training loader: determinism by (seed, epoch), every unit once per epoch, exact resume with workers, method
filter, DDP-equal epochs, corrupt images, and the ExampleContext helpers."""
from __future__ import annotations

import json
import random
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image
from test_data_helpers import StubMethod, World, jpeg, key_id

from clipfinetune.data.loader import ExampleContext, ShardLoader
from clipfinetune.data.prepare.shards import build_shards, write_index


def transform(im):
    return torch.from_numpy(np.asarray(im.resize((8, 8)), dtype=np.float32)).permute(2, 0, 1)


CTX = ExampleContext(transform, tokenize=lambda t: torch.zeros(len(t), 5, dtype=torch.long), image_size=8)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    World(root, n_coco=30, n_docci=14)
    sources = {"coco": {"reader": "coco", "captions": root / "captions.json", "images": root / "coco"},
               "docci": {"reader": "docci", "descriptions": root / "docci.jsonlines", "images": root / "docci"}}
    build_shards(root / "shards", prepared_dir=root / "prepared", sources=sources, splits=["train"],
                 prepared_from={"word_regions": "coco", "negatives": "coco", "local_pairs": "docci",
                                "sentences": ["docci"]}, maxcount=6, val_fraction=0.15)
    return root / "shards"


def records(shards, split):
    out = {}
    for p in sorted(shards.glob(f"{split}-*.tar")):
        with tarfile.open(p) as tf:
            for m in tf:
                if m.name.endswith(".json"):
                    rec = json.loads(tf.extractfile(m).read())
                    out[key_id(f"{rec['source']}_{rec['image_id']}")] = rec
    return out


def run(loader, epoch, start=0):
    return [(b["sample"].tolist(), b["draw"].tolist(), b["pixels"]) for b in loader.batches(epoch, start)]


def same(a, b):
    return len(a) == len(b) and all(x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2]) for x, y in zip(a, b))


def test_epoch_length_and_determinism_by_seed_and_epoch(shards):
    loader = ShardLoader(shards, "train", StubMethod(), CTX, batch_size=4, seed=3)
    n = len(records(shards, "train"))
    assert n % 4 and loader.num_wanted == n and loader.epoch_length(0) == -(-n // 4)     # the first batch past n
    e0 = run(loader, 0)
    assert len(e0) == loader.epoch_length(0) and all(len(s) == 4 for s, _, _ in e0)
    stream = [k for s, _, _ in e0 for k in s]
    assert sorted(stream[:n]) == sorted(records(shards, "train"))        # the pass: every sample exactly once ...
    assert len(stream) - n == 4 - n % 4                                  # ... then the next pass fills the batch
    e1 = run(loader, 1)                                                  # which epoch 1 does not read again
    assert len(e1) == -(-2 * n // 4) - -(-n // 4)
    assert sorted(stream[n:] + [k for s, _, _ in e1 for k in s][:n - (len(stream) - n)]) == sorted(stream[:n])
    assert same(e0, run(ShardLoader(shards, "train", StubMethod(), CTX, batch_size=4, seed=3), 0))
    assert not same(e0, run(loader, 1))
    assert not same(e0, run(ShardLoader(shards, "train", StubMethod(), CTX, batch_size=4, seed=4), 0))


class TorchDrawStub(StubMethod):
    """Draws from the worker's torch RNG (as a random augmentation would)."""

    def make_example(self, record, image, rng, ctx):
        return {**super().make_example(record, image, rng, ctx), "pixels": torch.rand(3)}


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_exact_resume_with_workers(shards):
    loader = ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=0, num_workers=2)
    full = run(loader, 2)
    assert len(full) == loader.epoch_length(2)
    assert same(full, run(loader, 2))                                   # persistent workers, same epoch again
    assert same(full, run(ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=0, num_workers=2), 2))
    assert same(full, run(ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=0, num_workers=3), 2))
    state = torch.get_rng_state()
    assert same(full, run(ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=0), 2))  # no worker
    assert torch.equal(state, torch.get_rng_state())                   # ... and the process's RNG untouched
    for k in (3, 4, loader.epoch_length(2)):
        fresh = ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=0, num_workers=2)
        assert same(run(fresh, 2, start=k), full[k:])                  # a restarted process resumes exactly


def test_each_example_seeds_torch_from_its_rng(shards):
    """The documented rule (module docstring): the example at stream position p gets rng = Random("seed:p") and its
    first draw, getrandbits(63), seeds torch's CPU generator before make_example; so an augmentation's torch draws
    are a function of the position (what resume and the sample DAG's bytes rely on). Epoch e of one rank with
    global batch 3 reads positions ceil(e n / 3) * 3 to ceil((e + 1) n / 3) * 3."""
    seed, epoch, n = 5, 1, len(records(shards, "train"))
    positions = range(-(-epoch * n // 3) * 3, -(-(epoch + 1) * n // 3) * 3)
    expected = []                                   # per position: (rng.random() (its 2nd draw), its torch draw)
    for p in positions:
        rng = random.Random(f"{seed}:{p}")
        gen = torch.Generator().manual_seed(rng.getrandbits(63))
        expected.append((rng.random(), torch.rand(3, generator=gen)))
    loader = ShardLoader(shards, "train", TorchDrawStub(), CTX, batch_size=3, seed=seed, num_workers=2)
    examples = [(d, p) for _, draws, pixels in run(loader, epoch) for d, p in zip(draws, pixels)]
    assert len(examples) == len(positions) == 3 * loader.epoch_length(epoch)
    assert all(d == want_d and torch.equal(p, want_p) for (d, p), (want_d, want_p) in zip(examples, expected))


def test_method_filter_is_counted_and_sizes_the_epoch(shards):
    docci = {k for k, r in records(shards, "train").items() if r["source"] == "docci"}
    loader = ShardLoader(shards, "train", StubMethod("goal_like", source="docci"), CTX, batch_size=2)
    assert loader.num_wanted == len(docci) and loader.epoch_length(0) == -(-len(docci) // 2)
    seen = {k for s, _, _ in run(loader, 0) for k in s}
    assert seen == docci
    assert loader.dropped_by_method == loader.num_samples - len(docci) == 0      # only the docci shards are opened
    assert loader.stats["batches"] == loader.epoch_length(0)
    with_pair = {k for k in docci if records(shards, "train")[k]["local_pair"]}
    some = ShardLoader(shards, "train", LocalPairStub(), CTX, batch_size=2)     # some records of the docci shards
    assert 0 < some.num_wanted == len(with_pair) < some.num_samples == len(docci)
    assert some.dropped_by_method == len(docci) - len(with_pair)
    assert {k for s, _, _ in run(some, 0) for k in s} == with_pair


class LocalPairStub(StubMethod):
    """Wants the records that carry a local pair (by a field, as every method does)."""

    def wants(self, record):
        return bool(record.get("local_pair"))


def test_ddp_ranks_get_the_same_number_of_batches(shards, monkeypatch):
    lengths, seen = [], set()
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        loader = ShardLoader(shards, "train", StubMethod(), CTX, batch_size=2, seed=0)
        batches = run(loader, 0)
        lengths.append((loader.epoch_length(0), len(batches)))
        seen |= {k for s, _, _ in batches for k in s}
    n = len(records(shards, "train"))
    assert lengths[0] == lengths[1] == (-(-n // 4), -(-n // 4))
    assert seen == set(records(shards, "train"))


def test_validation_loader_reads_every_sample_once(shards):
    loader = ShardLoader(shards, "val", StubMethod(), CTX, batch_size=4, train=False, num_workers=2)
    keys = [k for s, _, _ in run(loader, 0) for k in s]
    assert sorted(keys) == sorted(records(shards, "val")) and len(list(loader.batches(0))) == loader.epoch_length(0)


def test_a_corrupt_image_is_a_counted_skip_replaced_by_a_counted_repeat(tmp_path):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "train-000000.tar"), mtime=0) as w:
        for i in range(5):
            rec = {"image_id": str(i), "source": "coco", "captions": ["a"]}
            w.write({"__key__": f"coco_{i}", "jpg": b"garbage" if i == 2 else jpeg(10, 10, i), "txt": "a",
                     "json": json.dumps(rec).encode()})
    write_index(tmp_path)
    loader = ShardLoader(tmp_path, "train", StubMethod(), CTX, batch_size=2)
    batches = run(loader, 0)
    assert len(batches) == loader.epoch_length(0) == 3 and all(len(s) == 2 for s, _, _ in batches)   # sizes kept
    assert key_id("coco_2") not in {k for s, _, _ in batches for k in s}
    assert loader.stats["corrupt_images_skipped"] == loader.stats["units_repeated"] == 1


def test_boxes_are_refused_under_a_random_crop_transform():
    """random_resized_crop moves the pixels at random, so no box follows them: a box-reading method must say so, not
    train on boxes that point elsewhere (stages/train.py sets random_geometry from train_transform)."""
    ctx = ExampleContext(lambda im: im.size, tokenize=None, image_size=64, random_geometry=True)
    with pytest.raises(ValueError, match="squash"):
        ctx.resize_boxes([[0, 0, 10, 10]], (32, 32))
    plain = ExampleContext(lambda im: im.size, tokenize=None, image_size=64)
    assert plain.resize_boxes([[0, 0, 16, 16]], (32, 32)).tolist() == [[0.0, 0.0, 32.0, 32.0]]


def test_resize_boxes_and_crop():
    ctx = ExampleContext(lambda im: im.size, tokenize=None, image_size=64)
    boxes = ctx.resize_boxes([[10, 20, 50, 40]], (200, 100))
    assert torch.allclose(boxes, torch.tensor([[10 * 64 / 200, 20 * 64 / 100, 50 * 64 / 200, 40 * 64 / 100]]))
    image = Image.new("RGB", (200, 100))
    assert ctx.crop(image, [10, 20, 50, 40]) == (40, 20)
    assert ctx.crop(image, [10, 20, 50, 40], scale=1.5) == (60, 30)           # FineCLIP's 1.5x, about the centre
    assert ctx.crop(image, [180, 80, 200, 100], scale=3.0) == (40, 40)        # clamped to the image


def test_context_delegates_token_span():
    ctx = ExampleContext(None, None, 8, token_span=lambda text, s, e: list(range(s, e)))
    assert ctx.token_span("hello", 1, 3) == [1, 2]
    with pytest.raises(RuntimeError, match="tokenize_long"):
        ctx.tokenize_long(["x"])


class CaptionUnitStub(StubMethod):
    """A method whose epoch unit is the caption (as clip/FSC-CLIP/DeGLA): `unit` says which caption it drew."""
    epoch_unit = "caption"

    def __init__(self):
        super().__init__("caption_stub", source="coco")

    def units(self, record):
        return len(record["captions"])

    def unit_record(self, record, unit):
        return {**record, "captions": [record["captions"][unit]], "unit": unit}

    def make_example(self, record, image, rng, ctx):
        return {**super().make_example(record, image, rng, ctx), "unit": torch.tensor(record.get("unit", -1))}


def unit_pairs(batches):
    return [(s, u) for b in batches for s, u in zip(b["sample"].tolist(), b["unit"].tolist())]


def test_method_epoch_unit_visits_every_caption_once_in_a_seeded_order(shards):
    coco = {k: r for k, r in records(shards, "train").items() if r["source"] == "coco"}
    every = {(k, i) for k, r in coco.items() for i in range(len(r["captions"]))}
    assert len(every) > len(coco)                               # the world has images with several captions
    by_image = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=3)
    assert by_image.epoch_length(0) == -(-len(coco) // 4)       # epoch_unit image: one draw per image, as before
    loader = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=3, epoch_unit="method")
    assert loader.epoch_unit == "caption" and loader.num_units == len(every)
    assert loader.epoch_length(0) == -(-len(every) // 4)
    epoch0 = unit_pairs(loader.batches(0))
    assert len(epoch0) == 4 * loader.epoch_length(0)
    assert sorted(epoch0[:len(every)]) == sorted(every)         # each (image, caption) exactly once ...
    assert len(epoch0) - len(every) == 4 * loader.epoch_length(0) - len(every)     # ... then the next pass's fill
    epoch1 = unit_pairs(loader.batches(1))
    assert set(epoch1) <= every and epoch1 != epoch0            # a new seeded order every epoch
    again = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=3, epoch_unit="method")
    assert unit_pairs(again.batches(0)) == epoch0


def test_method_epoch_unit_resumes_exactly_with_workers(shards):
    def make():
        return ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=3, seed=0, num_workers=2,
                           epoch_unit="method")

    full = list(make().batches(1))
    for k in (3, 4, len(full) - 1):
        resumed = list(make().batches(1, start=k))
        assert len(resumed) == len(full) - k
        assert all(a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(resumed, full[k:]))


def test_epoch_unit_is_checked(shards):
    with pytest.raises(ValueError, match="epoch_unit"):
        ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=2, epoch_unit="caption")
    with pytest.raises(ValueError, match="training loaders"):
        ShardLoader(shards, "val", CaptionUnitStub(), CTX, batch_size=2, train=False, epoch_unit="method")


def test_epoch_samples_trains_every_epoch_on_one_fixed_seeded_sample_of_the_units(shards):
    """FSC-CLIP's 100K: a fixed sample of N captions, drawn once (seeded), each epoch one pass over it."""
    coco = {k: r for k, r in records(shards, "train").items() if r["source"] == "coco"}
    every = {(k, i) for k, r in coco.items() for i in range(len(r["captions"]))}
    n = 4 * (len(every) // 8)                                    # about half the captions, whole batches

    def make(seed=3):
        return ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=seed, epoch_unit="method",
                           epoch_samples=n)

    loader = make()
    assert loader.num_units == n and loader.epoch_length(0) == n // 4
    epoch0, epoch1 = unit_pairs(loader.batches(0)), unit_pairs(loader.batches(1))
    assert len(set(epoch0)) == len(epoch0) == n and set(epoch0) < every      # n distinct captions, no repeats
    assert set(epoch1) == set(epoch0) and epoch1 != epoch0                     # the same sample, a new order
    # the sample is the seeded draw over the sorted "<key>#<caption>" names (here by the keys' ids)
    names = sorted(f"coco_{r['image_id']}#{i}" for r in coco.values() for i in range(len(r["captions"])))
    drawn = random.Random("3:epoch_samples").sample(names, n)
    assert {(key_id(x.split("#")[0]), int(x.split("#")[1])) for x in drawn} == set(epoch0)
    assert set(unit_pairs(make(seed=4).batches(0))) != set(epoch0)
    assert make().stats == {} and loader.stats["examples"] == 2 * n          # only the sample's units are read
    whole = ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=4, seed=3, epoch_unit="method",
                        epoch_samples=10 ** 6)                  # more than there are: every unit, as 0
    assert whole.num_units == len(every)
    with pytest.raises(ValueError, match="epoch_samples"):
        ShardLoader(shards, "train", CaptionUnitStub(), CTX, batch_size=2, epoch_samples=-1)
