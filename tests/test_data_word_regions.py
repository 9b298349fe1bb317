"""HarmoCLIP word-region pairs: lemma matching, multi-word spans, one row per matched word, instance rule."""
from __future__ import annotations

import pandas as pd
import pytest
from test_data_helpers import coco_pair, img

from clipfinetune.data import word_regions as wrmod
from clipfinetune.data.word_regions import COLUMNS, build_word_regions
from clipfinetune.io import InputError

CATS = ["circle", "mouse", "ski", "traffic light", "teddy bear", "bear", "person", "box"]   # ids 1..8


def run(anns, caps, **kw):
    inst, capj = coco_pair([img(1), img(2)], anns, caps, CATS)
    return build_word_regions(inst, capj, **kw)


def words(frame):
    return list(zip(frame.caption_index, frame.word, frame.category))


def test_schema_and_span_of_a_plural():
    frame, meta = run([{"image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40]}], [(1, "Two circles on a table.")])
    assert list(frame.columns) == COLUMNS
    r = frame.iloc[0]
    assert (r.word, r.category, r.category_id, r.char_start, r.char_end) == ("circles", "circle", 1, 4, 11)
    assert r.caption[r.char_start:r.char_end] == "circles"
    assert [r.x0, r.y0, r.x1, r.y1] == [10, 20, 40, 60]       # xywh -> xyxy, original pixels
    assert (r.image_id, r.caption_id, r.caption_index) == (1, 1, 0)
    assert meta["rows"] == 1 and meta["captions_matched"] == 1


def test_irregular_plurals_match_and_lookalikes_do_not():
    anns = [{"image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5]}, {"image_id": 1, "category_id": 3, "bbox": [0, 0, 5, 5]}]
    frame, _ = run(anns, [(1, "Three mice under clear skies."), (1, "Skis and a MOUSE.")])
    assert words(frame) == [(0, "mice", "mouse"), (1, "Skis", "ski"), (1, "MOUSE", "mouse")]


def test_multi_word_categories_are_spans_and_consume_their_tokens():
    anns = [{"image_id": 1, "category_id": 4, "bbox": [0, 0, 5, 5]}, {"image_id": 1, "category_id": 5, "bbox": [1, 1, 5, 5]},
            {"image_id": 1, "category_id": 6, "bbox": [2, 2, 5, 5]}]
    frame, _ = run(anns, [(1, "Two traffic lights near a teddy bear."), (1, "A bear and the light of traffic.")])
    assert words(frame) == [(0, "traffic lights", "traffic light"), (0, "teddy bear", "teddy bear"), (1, "bear", "bear")]


def test_several_matched_words_give_several_rows_and_unmatched_captions_are_counted():
    anns = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]}, {"image_id": 1, "category_id": 8, "bbox": [0, 0, 9, 9]},
            {"image_id": 2, "category_id": 7, "bbox": [0, 0, 9, 9]}]
    frame, meta = run(anns, [(1, "A circle in a box."), (1, "Nothing to see."), (2, "A man walks."), (2, "A box.")])
    assert words(frame) == [(0, "circle", "circle"), (0, "box", "box")]
    assert meta["captions_dropped_no_match"] == 3      # no category word, a synonym ("man"), an absent category
    assert meta["images_matched"] == 1


def test_a_category_mentioned_twice_keeps_its_first_mention():
    frame, meta = run([{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]}], [(1, "A circle beside a circle.")])
    assert list(frame.char_start) == [2] and meta["repeated_mentions_dropped"] == 1


INSTANCES = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 4, 4], "id": 7},        # area 16, lowest id
             {"image_id": 1, "category_id": 1, "bbox": [50, 10, 10, 20], "id": 9},     # area 200: largest
             {"image_id": 1, "category_id": 1, "bbox": [5, 5, 100, 100], "id": 8, "iscrowd": 1},  # crowd: never
             {"image_id": 1, "category_id": 1, "bbox": [99, 79, 0, 3], "id": 10}]       # degenerate
@pytest.mark.parametrize("rule,expected", [("largest", [[50, 10, 60, 30]]), ("first", [[0, 0, 4, 4]]),
                                           ("all", [[0, 0, 4, 4], [50, 10, 60, 30]])])
def test_instance_rule(rule, expected):
    frame, meta = run([dict(a) for a in INSTANCES], [(1, "Circles everywhere.")], instance_rule=rule)
    assert frame[["x0", "y0", "x1", "y1"]].values.tolist() == expected
    assert meta["crowd_instances_ignored"] == 1 and meta["degenerate_boxes_skipped"] == 1


def test_boxes_are_clipped_to_the_image():
    frame, _ = run([{"image_id": 1, "category_id": 1, "bbox": [90, 70, 30, 30]}], [(1, "a circle")])   # image 100x80
    assert frame[["x0", "y0", "x1", "y1"]].values.tolist() == [[90, 70, 100, 80]]


def test_full_spacy_pipeline_agrees_with_the_lookup_path():
    anns = [{"image_id": 1, "category_id": c, "bbox": [0, 0, 5, 5]} for c in (1, 2, 4, 5, 8)]
    caps = [(1, "Two circles and three mice."), (1, "The traffic lights by a teddy bear."), (1, "He is boxing."),
            (1, "Boxes of circles.")]
    a, _ = run(anns, caps, lemmatizer="lookup")
    b, meta = run(anns, caps, lemmatizer="spacy")
    pd.testing.assert_frame_equal(a, b)
    assert meta["lemmatizer"] == "spacy"
    assert (2, "boxing") not in [(k, w) for k, w, _ in words(a)]     # a verb never matches `box`


def test_parallel_chunks_give_the_sequential_result(monkeypatch):
    anns = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]}, {"image_id": 2, "category_id": 8, "bbox": [1, 1, 5, 5]}]
    caps = [(1 + k % 2, f"{k} circles and boxes") for k in range(60)]
    seq, _ = run(anns, caps, processes=1)
    monkeypatch.setattr(wrmod, "PARALLEL_MIN_CAPTIONS", 10)
    par, _ = run(anns, caps, processes=2)
    pd.testing.assert_frame_equal(seq, par)
    assert len(seq) == 60


def test_bad_input_names_file_and_record():
    inst, capj = coco_pair([img(1)], [{"image_id": 1, "category_id": 99, "bbox": [0, 0, 1, 1], "id": 5}], [], CATS)
    with pytest.raises(InputError, match="instances.json.*5.*unknown category_id 99"):
        build_word_regions(inst, capj, instances_path="instances.json")
