"""Readers (clipfinetune/data/readers): image-text pairs (CSV, Parquet, WebDataset), Karpathy splits, the source
spec check and the one split rule. DOCCI/DCI/Urban1k/ShareGPT4V: tests/test_data_sentences.py; COCO:
tests/test_negatives.py, tests/test_data_word_regions.py; the eval side: tests/test_eval_readers.py."""
from __future__ import annotations

import io
import json
from collections import Counter

import pandas as pd
import pytest
from PIL import Image

from clipfinetune.data.readers import Record, in_splits, karpathy, pairs, read_source, source_paths, wds
from clipfinetune.io import InputError


def _jpeg(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (6, 4), colour).save(buf, format="JPEG")
    return buf.getvalue()


def test_pairs_group_rows_per_image_in_row_order_and_count_empty_captions(tmp_path):
    (tmp_path / "t.csv").write_text("filepath,title\na.jpg,a red  circle\nb.jpg,\"a blue, square\"\n"
                                    "a.jpg,two circles\nc.jpg,   \n")
    counts = Counter()
    recs = read_source("laion", {"reader": "pairs", "table": str(tmp_path / "t.csv"), "images": str(tmp_path),
                                 "image_column": "filepath", "caption_column": "title"}, counts)
    assert [(r.source, r.image_id, r.captions, r.path) for r in recs] == [
        ("laion", "a.jpg", ("a red circle", "two circles"), tmp_path / "a.jpg"),
        ("laion", "b.jpg", ("a blue, square",), tmp_path / "b.jpg")]
    assert counts == {"empty_captions_skipped": 1} and recs[0].split == "" and recs[0].long_caption == ""


def test_pairs_read_parquet_and_name_a_missing_column(tmp_path):
    pd.DataFrame({"image": ["x/1.jpg", "x/2.jpg"], "caption": ["one", "two"]}).to_parquet(tmp_path / "t.parquet")
    assert [r.captions for r in pairs.read(tmp_path / "t.parquet", tmp_path)] == [("one",), ("two",)]
    with pytest.raises(InputError, match=r"t\.parquet.*no column \['text'\]"):
        pairs.read(tmp_path / "t.parquet", tmp_path, caption_column="text")


def test_webdataset_samples_become_records_with_their_bytes(tmp_path):
    import webdataset

    with webdataset.TarWriter(str(tmp_path / "000000.tar")) as sink:
        sink.write({"__key__": "s0", "jpg": _jpeg((200, 0, 0)), "txt": "a red  square"})
        sink.write({"__key__": "s1", "txt": "no image"})
        sink.write({"__key__": "s2", "png": _jpeg((0, 0, 200)), "txt": "a blue square"})
    counts = Counter()
    recs = wds.read(str(tmp_path / "{000000..000000}.tar"), source="cc3m", counts=counts)
    assert [(r.image_id, r.captions) for r in recs] == [("s0", ("a red square",)), ("s2", ("a blue square",))]
    assert counts == {"samples_without_image_or_caption_skipped": 1}
    assert recs[0].image_bytes() == _jpeg((200, 0, 0)) and recs[0].read_image().getpixel((1, 1))[0] > 150


def test_karpathy_selects_splits_and_keeps_raw_sentences(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps({"images": [
        {"split": "train", "filepath": "train2014", "filename": "a.jpg", "imgid": 0,
         "sentences": [{"raw": "A cat."}, {"raw": "A  cat sits."}]},
        {"split": "test", "filepath": "val2014", "filename": "b.jpg", "imgid": 1, "sentences": [{"raw": "A dog."}]},
        {"split": "restval", "filepath": "val2014", "filename": "c.jpg", "imgid": 2, "sentences": [{"raw": "x"}]}]}))
    recs = karpathy.read(tmp_path / "k.json", tmp_path, splits=["train", "restval"])
    assert [(r.image_id, r.image, r.captions) for r in recs] == [
        ("0", "train2014/a.jpg", ("A cat.", "A  cat sits.")), ("2", "val2014/c.jpg", ("x",))]
    with pytest.raises(InputError, match="no images with split"):
        karpathy.read(tmp_path / "k.json", tmp_path, splits=["val"])


def test_a_source_spec_names_a_known_reader_and_only_its_keys():
    with pytest.raises(ValueError, match="unknown reader 'csv'"):
        read_source("x", {"reader": "csv", "table": "t.csv"})
    with pytest.raises(ValueError, match=r"sources\.x: reader 'pairs' takes .* not \['captions'\]"):
        read_source("x", {"reader": "pairs", "table": "t.csv", "captions": "c.json"})
    assert source_paths({"reader": "coco", "captions": "c.json", "images": "im"}) == ["c.json", "im"]


def test_a_record_without_a_split_is_in_every_selection():
    plain, train, test = (Record("s", "1", "1.jpg"), Record("s", "2", "2.jpg", split="train"),
                          Record("s", "3", "3.jpg", split="test"))
    assert [in_splits(r, ["train"]) for r in (plain, train, test)] == [True, True, False]
    assert all(in_splits(r, None) for r in (plain, train, test))
