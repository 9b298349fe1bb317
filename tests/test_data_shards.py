"""WebDataset shards: the sample JSON contract, byte-identical re-runs, open_clip reads them, counted skips."""
from __future__ import annotations

import argparse
import hashlib
import json
import tarfile
from pathlib import Path

import pytest
import torch
from test_data_helpers import World, jpeg

from clipfinetune.data.prepare.shards import build_shards
from clipfinetune.io import InputError

KEYS = {"image_id", "source", "width", "height", "captions", "long_caption", "word_regions", "sentences",
        "local_pair", "negatives"}


def sources(world: World) -> dict:
    return {"coco": {"reader": "coco", "captions": world.root / "captions.json", "images": world.root / "coco"},
            "docci": {"reader": "docci", "descriptions": world.root / "docci.jsonlines",
                      "images": world.root / "docci"}}


PREPARED_FROM = {"word_regions": "coco", "negatives": "coco", "local_pairs": "docci", "sentences": ["docci"]}


def build(world: World, out: Path, **kw):
    args = {"prepared_dir": world.root / "prepared", "sources": sources(world), "prepared_from": PREPARED_FROM,
            "splits": ["train"], "maxcount": 8, "val_fraction": 0.2}
    return build_shards(out, **{**args, **kw})


def read_all(out: Path) -> dict[str, dict]:
    samples = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf:
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {"__shard__": tar.name})[ext] = tf.extractfile(m).read()
    return samples


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    world = World(root)
    meta = build(world, root / "shards")
    return world, root / "shards", meta


def test_one_sample_per_training_image_with_every_annotation(built):
    world, out, meta = built
    samples = read_all(out)
    assert len(samples) == world.n_coco + world.n_docci           # the DOCCI test record is not a training image
    assert meta["samples_train"] + meta["samples_val"] == len(samples) and meta["samples_val"] > 0
    for key, s in samples.items():
        assert "." not in key and set(s) == {"__shard__", "jpg", "json", "txt"}
        rec = json.loads(s["json"])
        assert set(rec) == KEYS and key == f"{rec['source']}_{rec['image_id']}"
        assert all(isinstance(rec[k], list)
                   for k in ("captions", "word_regions", "sentences", "local_pair", "negatives"))
    coco = json.loads(samples["coco_3"]["json"])
    assert coco["captions"] == ["A red circle number 3.", "Two squares and a circle 3."]
    assert samples["coco_3"]["txt"] == b"A red circle number 3."
    assert (coco["width"], coco["height"]) == (43, 33) and coco["long_caption"] == "" and coco["sentences"] == []
    assert coco["word_regions"] == [{"caption_index": 0, "word": "circle", "char_span": [6, 12],
                                     "box": [1.0, 2.0, 11.0, 12.0], "category": "circle"}]
    assert coco["negatives"] == [{"caption_index": 1, "type": "swap_nouns",
                                  "texts": ["Two circles and a square 3.", "A circle and two squares 3."]}]
    assert samples["coco_3"]["jpg"] == (world.root / "coco" / "000000000003.jpg").read_bytes()   # no re-encode


def test_docci_sample_sentences_summary_and_local_pair(built):
    _, out, _ = built
    samples = read_all(out)
    long = "A blue star on grass. It is 3.5 cm wide. Dr. Who drew it 3."
    rec = json.loads(samples["docci_train_00003"]["json"])
    assert rec["long_caption"] == long and rec["captions"] == [] and rec["word_regions"] == []
    assert [s["text"] for s in rec["sentences"]] == ["A blue star on grass.", "It is 3.5 cm wide.",
                                                     "Dr. Who drew it 3."]
    assert all(long[s:e] == t["text"] for t in rec["sentences"] for s, e in [t["char_span"]])
    assert samples["docci_train_00003"]["txt"] == b"A blue star on grass."     # the summary sentence
    assert rec["local_pair"] == [{"sentence_index": 1, "box": [5.0, 6.0, 25.0, 30.0]}]       # chosen region
    assert json.loads(samples["docci_train_00004"]["json"])["local_pair"] == []              # global image won
    assert json.loads(samples["docci_train_00005"]["json"])["local_pair"] == []              # nothing chosen


def test_sizes_json_and_shard_names(built):
    _, out, _ = built
    sizes = json.loads((out / "sizes.json").read_text())
    assert sorted(sizes) == sorted(p.name for p in out.glob("*.tar"))
    counts = {}
    for s in read_all(out).values():
        counts[s["__shard__"]] = counts.get(s["__shard__"], 0) + 1
    assert sizes == counts and max(sizes.values()) <= 8
    assert all(n.startswith(("train-coco-", "val-coco-", "train-docci-", "val-docci-")) and n[-10:-4].isdigit()
               for n in sizes)
    for n in sizes:                                                         # one source per shard, in its name
        assert {json.loads(s["json"])["source"] for s in read_all(out).values() if s["__shard__"] == n} \
            == {n.split("-")[1]}


def test_index_lists_each_sources_shards_and_field_signatures(built):
    _, out, _ = built
    index = json.loads((out / "index.json").read_text())
    samples = read_all(out)
    for split in ("train", "val"):
        for source, entry in index[split].items():
            mine = [json.loads(s["json"]) for s in samples.values()
                    if s["__shard__"].startswith(f"{split}-") and json.loads(s["json"])["source"] == source]
            assert entry["samples"] == len(mine) == sum(sig["samples"] for sig in entry["signatures"])
            assert sorted(entry["shards"]) == sorted({s["__shard__"] for s in samples.values()
                                                      if s["__shard__"].startswith(f"{split}-{source}-")})
            carried = {tuple(f for f in ("captions", "long_caption", "word_regions", "sentences", "local_pair",
                                         "negatives") if rec[f]) for rec in mine}
            assert {tuple(sig["fields"]) for sig in entry["signatures"]} == carried
            assert all(sig["example"] in mine for sig in entry["signatures"])


def test_the_index_locates_every_members_bytes_by_offset(built):
    """index.json's record table: per record its shard and each member's byte offset and size, as tarfile finds
    them; every sample of the shards is listed once."""
    _, out, _ = built
    index = json.loads((out / "index.json").read_text())
    samples = read_all(out)
    listed = []
    for split in ("train", "val"):
        for entry in index[split].values():
            table = entry["records"]
            assert len(table["keys"]) == len(table["shard"]) == entry["samples"]
            for i, key in enumerate(table["keys"]):
                shard = out / entry["shards"][table["shard"][i]]
                assert samples[key]["__shard__"] == shard.name
                data = shard.read_bytes()
                for member in ("jpg", "json", "txt"):
                    at, size = table["offset"][member][i], table["size"][member][i]
                    assert data[at:at + size] == samples[key][member], (key, member)
                listed.append(key)
    assert sorted(listed) == sorted(samples)


def test_the_index_is_written_with_the_shards_atomically(built, tmp_path, monkeypatch):
    """The folder (tars, sizes.json, meta.json, index.json) is replaced as a whole: a failure while indexing leaves
    the previous shards and their index untouched, never tars beside a stale or missing index."""
    import shutil

    from clipfinetune.data.prepare import shards as shards_module

    world, out, _ = built
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}

    def killed(_):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards_module, "index_shards", killed)
    with pytest.raises(KeyboardInterrupt):
        build(world, copy, maxcount=3)                                  # other shards than before
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_sample_without_json_is_an_index_error_naming_shard_and_key(tmp_path):
    import webdataset as wds

    from clipfinetune.data.prepare.shards import write_index

    with wds.TarWriter(str(tmp_path / "train-000000.tar"), mtime=0) as w:
        w.write({"__key__": "coco_1", "jpg": jpeg(4, 4, 1), "json": json.dumps({"source": "coco"}).encode()})
        w.write({"__key__": "coco_2", "jpg": jpeg(4, 4, 2)})
    with pytest.raises(InputError, match="needs .jpg and .json") as err:
        write_index(tmp_path)
    assert "train-000000.tar" in str(err.value) and "coco_2" in str(err.value)
    assert not (tmp_path / "index.json").exists()


def test_rerun_is_byte_identical(built, tmp_path):
    world, out, _ = built
    build(world, tmp_path / "again")
    digest = lambda d: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}
    assert digest(out) == digest(tmp_path / "again")


def test_open_clip_reads_the_shards(built):
    """open_clip_train's own webdataset pipeline (shard shuffle, split, decode "pilrgb", rename jpg;png + txt,
    batches) reads the shards, with sizes.json giving the epoch size (no --train-num-samples)."""
    open_clip_data = pytest.importorskip("open_clip_train.data")
    from clipfinetune.data.open_clip_compat import patch

    patch()     # open_clip_train 3.3.0 x webdataset 1.0: end-of-shard marker fix (open_clip#935)
    _, out, _ = built
    from clipfinetune.data.prepare.shards import open_clip_pattern

    names = sorted(p.name for p in out.glob("train-*.tar"))
    sizes = json.loads((out / "sizes.json").read_text())
    assert "::" in open_clip_pattern([str(out / n) for n in names])            # one range per source
    args = argparse.Namespace(train_data=open_clip_pattern([str(out / n) for n in names]),
                              val_data=None, train_num_samples=None, train_data_upsampling_factors=None,
                              dataset_resampled=False, seed=0, batch_size=4, world_size=1, workers=0,
                              val_num_samples=None)
    info = open_clip_data.get_wds_dataset(args, lambda im: torch.tensor([*im.size, len(im.getbands())]), is_train=True,
                                          epoch=0, tokenizer=lambda text: torch.tensor([[len(text)]]))
    assert info.dataloader.num_samples == -(-sum(sizes[n] for n in names) // 4) * 4
    images, texts = next(iter(info.dataloader))
    assert images.shape == (4, 3) and (images[:, 2] == 3).all()          # PIL RGB images of their own size
    assert texts.shape == (4, 1) and (texts > 0).all()                    # the txt member, a caption


def test_corrupt_and_missing_images_are_counted_not_fatal(tmp_path):
    world = World(tmp_path / "w", n_coco=6, n_docci=3)
    (world.root / "coco" / "000000000002.jpg").write_bytes(jpeg(42, 32, 2)[:200])    # truncated JPEG
    (world.root / "coco" / "000000000004.jpg").unlink()
    (world.root / "docci" / "train_00001.jpg").write_bytes(b"not an image")
    meta = build(world, tmp_path / "out")
    assert meta["images_skipped_corrupt"] == 2 and meta["images_skipped_missing"] == 1
    assert set(read_all(tmp_path / "out")) == {"coco_1", "coco_3", "coco_5", "coco_6", "docci_train_00000",
                                                "docci_train_00002"}


def test_stale_annotation_rows_are_dropped_and_counted(tmp_path):
    world = World(tmp_path / "w", n_coco=3, n_docci=2)
    neg = world.prepared("negatives")
    neg.loc[0, "caption"] = "a caption that is not caption 1"
    neg.to_parquet(world.root / "prepared" / "negatives.parquet")
    wr = world.prepared("word_regions")
    wr.loc[0, "caption_index"] = 7
    wr.to_parquet(world.root / "prepared" / "word_regions.parquet")
    meta = build(world, tmp_path / "out")
    assert meta["negatives_stale_dropped"] == 1 and meta["word_regions_stale_dropped"] == 1
    rec = json.loads(read_all(tmp_path / "out")["coco_1"]["json"])
    assert rec["word_regions"] == [] and rec["negatives"][0]["texts"] == ["A circle and two squares 1."]


def test_a_table_joins_only_the_records_of_its_own_source(tmp_path):
    """The same image ids under another source name get none of the coco source's word regions or negatives."""
    world = World(tmp_path / "w", n_coco=3, n_docci=1)
    specs = sources(world)
    specs["other"] = dict(specs["coco"])
    meta = build(world, tmp_path / "out", sources=specs)
    samples = read_all(tmp_path / "out")
    coco, other = json.loads(samples["coco_3"]["json"]), json.loads(samples["other_3"]["json"])
    assert coco["word_regions"] and coco["negatives"]
    assert other["captions"] == coco["captions"] and other["word_regions"] == [] and other["negatives"] == []
    assert meta["samples_train"] + meta["samples_val"] == 2 * 3 + 1


def test_a_missing_prepared_file_names_its_stage(tmp_path):
    world = World(tmp_path / "w", n_coco=2, n_docci=1)
    (world.root / "prepared" / "local_pairs.parquet").unlink()
    with pytest.raises(InputError, match="local_pairs.parquet.*stage `lism`"):
        build(world, tmp_path / "out")
    assert not (tmp_path / "out").exists()
