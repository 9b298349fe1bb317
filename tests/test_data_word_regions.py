"""HarmoCLIP word-region pairs: lemma matching, multi-word spans, one row per matched word, instance rule."""
from __future__ import annotations

from collections import Counter

import pandas as pd
import pytest
from test_data_helpers import coco_pair, img

from clipfinetune.data.prepare import instance_boxes
from clipfinetune.data.prepare import word_regions as wrmod
from clipfinetune.data.prepare.word_regions import COLUMNS, build_word_regions
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
    anns = [{"image_id": 1, "category_id": 2, "bbox": [0, 0, 5, 5]},
            {"image_id": 1, "category_id": 3, "bbox": [0, 0, 5, 5]}]
    frame, _ = run(anns, [(1, "Three mice under clear skies."), (1, "Skis and a MOUSE.")])
    assert words(frame) == [(0, "mice", "mouse"), (1, "Skis", "ski"), (1, "MOUSE", "mouse")]


def test_multi_word_categories_are_spans_and_consume_their_tokens():
    anns = [{"image_id": 1, "category_id": 4, "bbox": [0, 0, 5, 5]},
            {"image_id": 1, "category_id": 5, "bbox": [1, 1, 5, 5]},
            {"image_id": 1, "category_id": 6, "bbox": [2, 2, 5, 5]}]
    frame, _ = run(anns, [(1, "Two traffic lights near a teddy bear."), (1, "A bear and the light of traffic.")])
    assert words(frame) == [(0, "traffic lights", "traffic light"), (0, "teddy bear", "teddy bear"),
                            (1, "bear", "bear")]


def test_several_matched_words_give_several_rows_and_unmatched_captions_are_counted():
    anns = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]},
            {"image_id": 1, "category_id": 8, "bbox": [0, 0, 9, 9]},
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
    anns = [{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]},
            {"image_id": 2, "category_id": 8, "bbox": [1, 1, 5, 5]}]
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


# ------------------------------------------------------------------ fast paths vs the reference code paths
def _random_instances(seed: int, n_images: int = 30):
    import random

    rng = random.Random(seed)
    images = {i: img(i, rng.choice([100, 64]), rng.choice([80, 48])) for i in range(1, n_images + 1)}
    anns = []
    for k in range(1, 12 * n_images):
        x, y = rng.choice([0, 5, 90, 120, -10, 33.5]), rng.choice([0, 7, 70, 100, -3.25])
        w, h = rng.choice([0, 4, 10, 10, 50.5, 200]), rng.choice([0, 4, 10, 10, 30.25])   # ties, zero, overflow
        anns.append({"id": rng.choice([k, k, 3]), "image_id": rng.randint(1, n_images),   # repeated ids too
                     "category_id": rng.randint(1, 4), "bbox": [x, y, w, h], "iscrowd": int(rng.random() < 0.1)})
    rng.shuffle(anns)
    return {"images": list(images.values()), "annotations": anns}, images


@pytest.mark.parametrize("rule", ["largest", "first", "all"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_box_choice_equals_the_scalar_path(rule, seed):
    from collections import Counter

    inst, images = _random_instances(seed)
    names = {c: f"c{c}" for c in range(1, 5)}
    c_np, c_sc = Counter(), Counter()
    fast = instance_boxes.boxes_np(inst, images, names, rule, c_np)
    anns = instance_boxes.instances_checked(inst, images, names, "<instances>")
    slow = instance_boxes.boxes_scalar(anns, images, rule, c_sc)
    assert fast is not None and c_np == c_sc and c_np["degenerate_boxes_skipped"] > 0
    (fb, fmap), (sb, smap) = fast, slow
    for i in images:            # same boxes per (image, category), in the same order
        assert {c: fb[r].tolist() for c, r in fmap[i].items()} == {c: sb[r].tolist() for c, r in smap[i].items()}


def test_records_the_fast_path_cannot_take_fall_back_to_the_reference_path():
    images = {1: img(1)}
    names = {1: "circle"}
    for bad in ({"id": "a", "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]},       # non-integer id
                {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5]},            # short box
                {"id": 1, "image_id": 1, "category_id": 1, "bbox": [float("nan"), 0, 5, 5]},
                {"id": 1, "image_id": 2, "category_id": 1, "bbox": [0, 0, 5, 5]},         # unknown image
                {"id": 1, "image_id": 1, "bbox": [0, 0, 5, 5]}):                          # missing key
        assert instance_boxes.boxes_np({"annotations": [bad]}, images, names, "largest", Counter()) is None
    with pytest.raises(InputError, match="instances.json.*lacks keys"):
        build_word_regions(*coco_pair([img(1)], [{"image_id": 1, "bbox": [0, 0, 1, 1]}], [(1, "a circle")], CATS),
                           instances_path="instances.json")
    nan_box = [{"image_id": 1, "category_id": 1, "bbox": [float("nan"), 0, 30, 40]}]
    frame, meta = run(nan_box, [(1, "a circle")])    # scalar path: clip_box clamps NaN to 0 -> zero width
    assert frame.empty and meta["degenerate_boxes_skipped"] == 1


TRICKY = ["Two circles.", "A (circle), a box; and mice!", "teddy-bear's box", "U.S. traffic lights, e.g. two.",
          "A circle:) next to boxes...", "Mr. Bear's circles'", "circle/box 3.5m", "naïve café circles",
          "THE TEDDY BEAR AND A BEAR", "a teddy bear bear box-box", "\"Circles\" and 'boxes'", "skis, skies, ski's"]


def test_caption_chunk_cache_equals_the_whole_text_tokenizer():
    matcher = wrmod.CategoryMatcher({i + 1: n for i, n in enumerate(CATS)})
    whole = [matcher.text_tokens(t) for t in TRICKY]
    assert [matcher.caption_tokens(t) for t in TRICKY] == whole
    assert [matcher.caption_tokens(t) for t in TRICKY] == whole           # again, from the cache
    assert any(("", "", -1, -1) in toks for toks in whole)                 # the blank separator is exercised
    assert ("circles", "circle", 4, 11) in whole[0] and ("teddy", "teddy", 0, 5) in whole[2]
    assert matcher.caption_tokens("a  circle\tbox") == matcher.text_tokens("a  circle\tbox")   # fallback


def test_an_empty_result_keeps_the_schema_dtypes():
    frame, meta = run([{"image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5]}], [(1, "Nothing here.")])
    expected = pd.DataFrame([], columns=COLUMNS).astype(
        {"image_id": "int64", "caption_id": "int64", "caption_index": "int32", "char_start": "int32",
         "char_end": "int32", "category_id": "int32", "x0": "float32", "y0": "float32", "x1": "float32",
         "y1": "float32"})
    pd.testing.assert_frame_equal(frame, expected)
    assert meta["rows"] == 0 and meta["captions_dropped_no_match"] == 1


def test_load_json_reads_like_the_stdlib_reference(tmp_path):
    from clipfinetune.data.readers.coco import load_json, load_json_stdlib

    good = tmp_path / "good.json"
    good.write_text('{"images": [{"id": 1, "w": 0.30000000000000004, "c": "caf\\u00e9 \\ud83d\\ude00"}], "x": -0.0}')
    assert load_json(good) == load_json_stdlib(good)
    for name, data in (("bad.json", b'{"images": ['), ("latin1.json", b'{"caption": "caf\xe9"}'),
                       ("missing.json", None)):
        p = tmp_path / name
        if data is not None:
            p.write_bytes(data)
        with pytest.raises(InputError) as ref:
            load_json_stdlib(p)
        with pytest.raises(InputError) as ours:
            load_json(p)
        assert str(ours.value) == str(ref.value)


def test_chair_synonyms_pair_man_with_person_and_bike_with_bicycle_only_when_asked():
    """COCO's CHAIR synonym table (word_regions.synonyms: chair): a synonym of an annotated category is a mention."""
    inst = {"images": [{"id": 1, "file_name": "a.jpg", "width": 100, "height": 100}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 50, 50], "area": 2500.0,
                             "iscrowd": 0},
                            {"id": 2, "image_id": 1, "category_id": 2, "bbox": [50, 50, 40, 40], "area": 1600.0,
                             "iscrowd": 0}],
            "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": "bicycle"}, {"id": 3, "name": "dog"}]}
    caps = {"images": inst["images"],
            "annotations": [{"id": 10, "image_id": 1, "caption": "A man rides his bike past two puppies."}]}
    plain, meta = build_word_regions(inst, caps)
    assert plain.empty and meta["synonyms"] == "none"
    frame, meta = build_word_regions(inst, caps, synonyms="chair")
    assert frame[["word", "category"]].values.tolist() == [["man", "person"], ["bike", "bicycle"]]
    assert meta["synonyms"] == "chair"                      # "puppies" -> dog is a synonym too, but no dog box
    with pytest.raises(ValueError, match="synonyms must be one of"):
        build_word_regions(inst, caps, synonyms="wordnet")
