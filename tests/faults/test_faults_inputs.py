"""Bad inputs through the real stages (in-process `main()` on a copy of the tiny project): each fault is either an
InputError naming the file AND the record, or a counted skip in the stage's metadata -- never a library
traceback, never a silent loss."""
from __future__ import annotations

import io
import json
import tarfile

import pandas as pd
import pytest

from clipfinetune.io import InputError

from .conftest import corrupt_jpeg

pytestmark = pytest.mark.faults

CAPTIONS = "data/sample/annotations/captions_train.json"
PRETRAIN_CAPTIONS = "data/sample/annotations/captions_pretrain.json"   # what `pretrain` reads
INSTANCES = "data/sample/annotations/instances_train.json"
DOCCI = "data/sample/docci/descriptions.jsonlines"
PREPARED = ["data/prepared/word_regions.parquet", "data/prepared/sentences.parquet",
            "data/prepared/local_pairs.parquet", "data/prepared/negatives.parquet"]


def load(proj, rel):
    return json.loads((proj / rel).read_text())


def dump(proj, rel, obj):
    (proj / rel).write_text(json.dumps(obj))


def docci_lines(proj):
    return [json.loads(line) for line in (proj / DOCCI).read_text().splitlines() if line.strip()]


def write_docci(proj, records):
    (proj / DOCCI).write_text("".join(json.dumps(r) + "\n" for r in records))


def assert_names(err: InputError, path, record):
    message = str(err)
    assert str(path) in message, message
    assert str(record) in message, message


def assert_stages_fail_naming(inprocess, proj, stages, path, record) -> list[InputError]:
    """Each stage, run in turn, raises an InputError that names `path` and `record`; returns the errors."""
    errors = []
    for stage in stages:
        with pytest.raises(InputError) as err:
            inprocess(proj, stage)
        assert_names(err.value, path, record)
        errors.append(err.value)
    return errors


def shard_keys(proj):
    keys = set()
    for tar in (proj / "data/shards").glob("*.tar"):
        with tarfile.open(tar) as t:
            keys |= {m.name.split(".")[0] for m in t.getmembers()}
    return keys


def shard_records(proj):
    out = {}
    for tar in (proj / "data/shards").glob("*.tar"):
        with tarfile.open(tar) as t:
            for m in t.getmembers():
                if m.name.endswith(".json"):
                    out[m.name.split(".")[0]] = json.load(io.TextIOWrapper(t.extractfile(m)))
    return out


# ------------------------------------------------------------------------------------------ captions (COCO JSON)
def test_empty_and_punctuation_only_captions_are_counted(tiny_project, tmp_path, inprocess):
    ref_wr = tiny_project.meta("data/prepared/word_regions.meta.json")
    ref_neg = tiny_project.meta("data/prepared/negatives.meta.json")
    ref_sh = tiny_project.meta("data/shards/meta.json")
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", *PREPARED])
    caps = load(proj, CAPTIONS)
    empty, punct = caps["annotations"][0], caps["annotations"][1]
    empty["caption"], punct["caption"] = "   ", "?! ... !!"
    dump(proj, CAPTIONS, caps)

    inprocess(proj, "word_regions")
    wr = proj.meta("data/prepared/word_regions.meta.json")
    assert wr["empty_captions_skipped"] == 1
    assert wr["captions"] == ref_wr["captions"] - 1
    # the punctuation-only caption matched no category word: dropped and counted as such
    assert wr["captions_dropped_no_match"] == ref_wr["captions_dropped_no_match"] + 1
    frame = pd.read_parquet(proj / "data/prepared/word_regions.parquet")
    assert not frame.caption_id.isin([empty["id"], punct["id"]]).any()

    inprocess(proj, "negatives")
    neg = proj.meta("data/prepared/negatives.meta.json")
    assert neg["skipped"] == {"empty_captions_skipped": 1}   # the COCO reader's one rule (as word_regions)
    assert neg["captions"] == ref_neg["captions"] - 1
    rows = pd.read_parquet(proj / "data/prepared/negatives.parquet")
    assert not (rows.caption == "?! ... !!").any()      # no negative of a caption without words
    # ... its five answers are rejected and counted
    assert sum(neg["rejects"].values()) > sum(ref_neg["rejects"].values())

    inprocess(proj, "shards")
    sh = proj.meta("data/shards/meta.json")
    assert sh["empty_captions_skipped"] == 1
    recs = shard_records(proj)
    key = f"coco_{empty['image_id']}"
    if key in recs:
        assert "" not in recs[key]["captions"] and len(recs[key]["captions"]) == 4
    assert sh["samples_train"] + sh["samples_val"] == ref_sh["samples_train"] + ref_sh["samples_val"]


def test_non_utf8_caption_file_names_file_and_annotation(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", *PREPARED])
    caps = load(proj, CAPTIONS)
    victim = caps["annotations"][3]
    victim["caption"] = "A red MARKER circle."
    raw = json.dumps(caps).encode().replace(b"MARKER", b"\xff\xfe caf\xe9")
    (proj / CAPTIONS).write_bytes(raw)
    errors = assert_stages_fail_naming(inprocess, proj, ("word_regions", "negatives", "shards"),
                                       CAPTIONS, victim["id"])
    pre = load(proj, PRETRAIN_CAPTIONS)               # pretrain reads its own split's captions
    pre_victim = pre["annotations"][3]
    pre_victim["caption"] = "A red MARKER circle."
    (proj / PRETRAIN_CAPTIONS).write_bytes(json.dumps(pre).encode().replace(b"MARKER", b"\xff\xfe caf\xe9"))
    errors += assert_stages_fail_naming(inprocess, proj, ("pretrain",), PRETRAIN_CAPTIONS, pre_victim["id"])
    for err in errors:
        assert "UTF-8" in str(err)


def test_non_utf8_docci_file_names_file_and_example(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", "models/base", *PREPARED,
                                               "data/prepared/segments.parquet"])
    recs = docci_lines(proj)
    recs[2]["description"] = "A MARKER picture."
    raw = "".join(json.dumps(r) + "\n" for r in recs).encode().replace(b"MARKER", b"caf\xe9")
    (proj / DOCCI).write_bytes(raw)
    assert_stages_fail_naming(inprocess, proj, ("sentences", "segments", "lism", "shards"),
                              DOCCI, recs[2]["example_id"])


# ------------------------------------------------------------------------------------------ boxes, ids
def test_zero_area_and_outside_boxes_are_skipped_and_counted(tiny_project, tmp_path, inprocess):
    ref = tiny_project.meta("data/prepared/word_regions.meta.json")
    proj = tiny_project.clone(tmp_path / "p", ["data/sample"])
    inst = load(proj, INSTANCES)
    zero, outside = inst["annotations"][0], inst["annotations"][1]
    zero["bbox"] = [10, 10, 0, 5]
    img = next(i for i in inst["images"] if i["id"] == outside["image_id"])
    outside["bbox"] = [img["width"] + 5, img["height"] + 5, 10, 10]
    dump(proj, INSTANCES, inst)
    inprocess(proj, "word_regions")
    meta = proj.meta("data/prepared/word_regions.meta.json")
    assert meta["degenerate_boxes_skipped"] == ref["degenerate_boxes_skipped"] + 2
    frame = pd.read_parquet(proj / "data/prepared/word_regions.parquet")
    assert ((frame.x1 > frame.x0) & (frame.y1 > frame.y0)).all()
    assert (frame.x1 <= 64).all() and (frame.y1 <= 64).all() and (frame.x0 >= 0).all()


def test_duplicate_image_ids_are_an_error_naming_file_and_id(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", "models/base", "data/prepared/sentences.parquet",
                                               "data/prepared/segments.parquet"])
    inst = load(proj, INSTANCES)
    dup = dict(inst["images"][2], file_name="other.jpg")
    inst["images"].append(dup)
    dump(proj, INSTANCES, inst)
    assert_stages_fail_naming(inprocess, proj, ("word_regions",), INSTANCES, dup["id"])

    recs = docci_lines(proj)
    write_docci(proj, [*recs, dict(recs[1], image_file=recs[0]["image_file"])])
    assert_stages_fail_naming(inprocess, proj, ("sentences", "segments", "lism"),
                              DOCCI, recs[1]["example_id"])


# ------------------------------------------------------------------------------------------ long captions
def test_long_caption_without_sentence_boundary_is_kept_whole(tiny_project, tmp_path, inprocess):
    ref = tiny_project.meta("data/prepared/sentences.meta.json")
    proj = tiny_project.clone(tmp_path / "p", ["data/sample"])
    recs = docci_lines(proj)
    words = " ".join(f"a red circle number {i} beside a blue square" for i in range(60))   # 480 words, no stop
    recs[0]["description"], recs[1]["description"] = words, "  \n "
    recs[2]["description"] = "... !!! ;"
    write_docci(proj, recs)
    inprocess(proj, "sentences")
    meta = proj.meta("data/prepared/sentences.meta.json")
    frame = pd.read_parquet(proj / "data/prepared/sentences.parquet")
    mine = frame[frame.image_id == recs[0]["example_id"]].sort_values("sentence_index")
    assert len(mine) >= 1 and mine.long_caption.iloc[0] == words
    kept = " ".join(mine.text)
    if len(mine) < meta["max_sentences"]:     # nothing dropped: every word is in some sentence
        assert kept.split() == words.split()
    else:
        assert meta["captions_over_cap"] >= 1
    # the blank and the punctuation-only descriptions: skipped and counted
    assert not frame.image_id.isin([recs[1]["example_id"], recs[2]["example_id"]]).any()
    assert meta["empty_long_captions_skipped"] == ref["empty_long_captions_skipped"] + 2
    assert meta["punctuation_only_sentences_skipped"] >= ref["punctuation_only_sentences_skipped"] + 1


# ------------------------------------------------------------------------------------------ images
def test_corrupt_and_missing_images_are_skipped_and_counted(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", "models/base", *PREPARED[:2], PREPARED[3],
                                               "data/prepared/segments.parquet"])
    caps = load(proj, CAPTIONS)
    by_id = {i["id"]: i["file_name"] for i in caps["images"]}
    ids = sorted(by_id)
    corrupt_jpeg(proj / "data/sample/images/train" / by_id[ids[0]])
    (proj / "data/sample/images/train" / by_id[ids[1]]).unlink()
    recs = docci_lines(proj)
    train = [r for r in recs if r["split"] == "train"]
    corrupt_jpeg(proj / "data/sample/docci/images" / train[0]["image_file"])
    (proj / "data/sample/docci/images" / train[1]["image_file"]).unlink()

    inprocess(proj, "segments")
    seg = proj.meta("data/prepared/segments.meta.json")
    skipped = {s["image_id"]: s["file"] for s in seg["skipped"]}
    assert set(skipped) == {train[0]["example_id"], train[1]["example_id"]}
    assert all(s.endswith(train[i]["image_file"]) for i, s in enumerate(skipped[r["example_id"]] for r in train[:2]))

    inprocess(proj, "lism")
    lism = proj.meta("data/prepared/local_pairs.meta.json")
    assert {s["image_id"] for s in lism["skipped"]} == {train[0]["example_id"], train[1]["example_id"]}

    inprocess(proj, "shards")
    sh = proj.meta("data/shards/meta.json")
    assert sh["images_skipped_corrupt"] == 2 and sh["images_skipped_missing"] == 2
    keys = shard_keys(proj)
    for gone in (f"coco_{ids[0]}", f"coco_{ids[1]}", f"docci_{train[0]['example_id']}",
                 f"docci_{train[1]['example_id']}"):
        assert gone not in keys
    assert sh["samples_train"] + sh["samples_val"] == sh["records"] - 4

    # pretrain reads its own split's images itself: a clear error naming the corrupt one
    pre = {i["id"]: i["file_name"] for i in load(proj, PRETRAIN_CAPTIONS)["images"]}
    victim = min(pre)
    corrupt_jpeg(proj / "data/sample/images/pretrain" / pre[victim])
    assert_stages_fail_naming(inprocess, proj, ("pretrain",), pre[victim], victim)
