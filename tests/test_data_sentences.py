"""Long captions -> sentences: spans into the caption, no split on decimals/abbreviations, the cap, readers."""
from __future__ import annotations

import json

import pytest

from clipfinetune.data.prepare.sentences import COLUMNS, split_sentences
from clipfinetune.data.readers import Record, dci, docci, sharegpt4v, urban1k
from clipfinetune.io import InputError


def rec(text, image_id="a", source="docci"):
    return Record(source=source, image_id=image_id, image=f"{image_id}.jpg", long_caption=text)


def texts(frame, image_id="a"):
    return frame[frame.image_id == image_id].sort_values("sentence_index").text.tolist()


def test_schema_summary_first_and_spans_reconstruct_the_caption():
    long = "  A red mug on a table.\nThe handle faces right.  Daytime.  "
    frame, meta = split_sentences([rec(long)])
    assert list(frame.columns) == COLUMNS
    assert texts(frame) == ["A red mug on a table.", "The handle faces right.", "Daytime."]
    assert frame.sentence_index.tolist() == [0, 1, 2]
    stored = long.strip()
    assert (frame.long_caption == stored).all()
    for r in frame.itertuples():
        assert stored[r.char_start:r.char_end] == r.text
    assert meta["long_captions"] == 1 and meta["segmenter"].endswith("senter")


def test_decimals_and_abbreviations_do_not_split():
    long = "The bottle holds 3.5 liters of water. Dr. Smith stands next to it, e.g. on the left. It is blue."
    frame, _ = split_sentences([rec(long)])
    assert texts(frame) == ["The bottle holds 3.5 liters of water.", "Dr. Smith stands next to it, e.g. on the left.",
                            "It is blue."]


def test_at_most_max_sentences_are_kept_and_the_rest_counted():
    long = " ".join(f"Sentence number {i} is here." for i in range(7))
    frame, meta = split_sentences([rec(long), rec("One. Two.", "b")], max_sentences=5)
    assert texts(frame) == [f"Sentence number {i} is here." for i in range(5)]
    assert (frame[frame.image_id == "a"].long_caption == long).all()        # the long caption stays whole
    assert meta["sentences_dropped_over_cap"] == 2 and meta["captions_over_cap"] == 1
    assert texts(frame, "b") == ["One.", "Two."]


def test_no_boundary_is_one_sentence_and_empty_captions_are_skipped_and_counted():
    frame, meta = split_sentences([rec("a small red ring without a full stop", "a"), rec("   ", "b"), rec("", "c"),
                                   rec("...", "d")])
    assert texts(frame) == ["a small red ring without a full stop"]
    assert set(frame.image_id) == {"a"}
    assert meta["empty_long_captions_skipped"] == 3 and meta["single_sentence_captions"] == 1


def test_duplicate_ids_are_an_input_error():
    with pytest.raises(InputError, match="duplicate"):
        split_sentences([rec("A."), rec("B.")])


def test_docci_reader_keeps_splits_and_rejects_bad_lines(tmp_path):
    p = tmp_path / "docci_descriptions.jsonlines"
    p.write_text('{"example_id": "train_00000", "split": "train", "image_file": "train_00000.jpg", '
                 '"description": "A."}\n'
                 '{"example_id": "test_00000", "split": "test", "image_file": "test_00000.jpg", "description": "B."}\n')
    assert [r.image_id for r in docci.read(p)] == ["train_00000", "test_00000"]
    assert [(r.image, r.split) for r in docci.read(p, splits=("train",))] == [("train_00000.jpg", "train")]
    p.write_text('{"example_id": "train_00001", "split": "train"}\n')
    with pytest.raises(InputError, match="train_00001.*missing keys"):
        docci.read(p)
    p.write_text('{"example_id": "train_00001", "image_file": "a.jpg", "description": "A."}\n')
    with pytest.raises(InputError, match="train_00001.*missing keys.*split"):     # no default split
        docci.read(p)


def test_dci_urban1k_sharegpt4v_readers(tmp_path):
    dci_root = tmp_path / "densely_captioned_images"
    (dci_root / "complete").mkdir(parents=True)
    (dci_root / "complete" / "sa_1.json").write_text(json.dumps(
        {"image": "sa_1.jpg", "short_caption": "A door.", "extra_caption": "The door is blue. Ivy grows.",
         "mask_data": {}}))
    (dci_root / "splits.json").write_text(json.dumps({"train": ["sa_1.json"], "test": []}))
    (r,) = dci.read(dci_root, splits=["train"])
    assert (r.image_id, r.source, r.long_caption, r.path, r.split) == (
        "sa_1", "dci", "The door is blue. Ivy grows.", dci_root / "photos" / "sa_1.jpg", "train")
    urban = tmp_path / "Urban1k"
    (urban / "caption").mkdir(parents=True)
    for n in (10, 2):
        (urban / "caption" / f"{n}.txt").write_text(f"Street {n} at dusk. Cars pass.\nsecond line ignored\n")
    assert [(r.image_id, r.long_caption, r.path) for r in urban1k.read(urban)] == [
        ("2", "Street 2 at dusk. Cars pass.", urban / "image" / "2.jpg"),
        ("10", "Street 10 at dusk. Cars pass.", urban / "image" / "10.jpg")]
    share = tmp_path / "sharegpt4v.json"
    share.write_text(json.dumps([{"id": f"{i:012d}", "image": f"coco/train2017/{i:012d}.jpg", "conversations": [
        {"from": "human", "value": "<image>\nDescribe."}, {"from": "gpt", "value": f"Lunch box {i}.\nBroccoli."}]}
        for i in range(3)]))
    recs = sharegpt4v.read(share, skip_first=1)
    assert [(r.image_id, r.long_caption) for r in recs] == [("000000000001", "Lunch box 1.\nBroccoli."),
                                                                   ("000000000002", "Lunch box 2.\nBroccoli.")]
    frame, meta = split_sentences(recs)
    assert texts(frame, "000000000001") == ["Lunch box 1.", "Broccoli."]       # a line break ends a sentence
    assert meta["long_captions_sharegpt4v"] == 2


def test_goals_period_splitter_is_split_on_dot_stripped_without_empties():
    long = "The bottle holds 3.5 liters. Dr. Smith waves!\nIt is blue.. "
    frame, meta = split_sentences([rec(long)], splitter="period")
    pieces = [p.strip() for p in long.strip().split(".") if p.strip()]     # GOAL's LISM, written out
    assert texts(frame) == pieces == ["The bottle holds 3", "5 liters", "Dr", "Smith waves!\nIt is blue"]
    stored = long.strip()
    assert all(stored[r.char_start:r.char_end] == r.text for r in frame.itertuples())
    assert "split on '.'" in meta["segmenter"]


def test_mulclips_punctuation_splitter_ends_sentences_after_punctuation_runs_and_line_breaks():
    long = "Is it a mug? Yes!! It is red...\nThe handle faces right"
    frame, _ = split_sentences([rec(long)], splitter="punctuation", max_sentences=4)
    assert texts(frame) == ["Is it a mug?", "Yes!!", "It is red...", "The handle faces right"]
    frame, meta = split_sentences([rec(long)], splitter="punctuation", max_sentences=2)
    assert texts(frame) == ["Is it a mug?", "Yes!!"] and meta["sentences_dropped_over_cap"] == 2
    with pytest.raises(ValueError, match="splitter must be one of"):
        split_sentences([rec(long)], splitter="nltk")
