"""The sample world's texts are true of their images, and its negatives are false (read independently)."""
from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from pycocotools.coco import COCO
from test_sample_truth import RELATION, SMALL_WORLD, caption_is_true, parse, scenes, shape_words, tiny_world

KINDS = ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att", "add_obj", "add_att"]
SYMMETRIC = {"near", "next to", "beside", "by", "with", "on the side of", "around", "of", "and"}


def _captions(split):
    root = tiny_world()
    caps = COCO(str(root / f"annotations/captions_{split}.json"))
    recs = scenes(root)
    for iid, img in caps.imgs.items():
        objs = recs[f"images/{split}/{img['file_name']}"]["objects"]
        yield objs, [a["caption"] for a in caps.loadAnns(caps.getAnnIds(imgIds=[iid]))]


@pytest.mark.parametrize("split", ["train", "val"])
def test_short_captions_are_true_of_their_image(split):
    for objs, texts in _captions(split):
        for t in texts:
            nps, _, _ = parse(t)
            assert nps and len(nps) == shape_words(t), t          # every shape word is read
            assert caption_is_true(t, objs), (t, objs)


def test_short_captions_mention_some_objects_with_varied_wording():
    texts, partial = [], 0
    for objs, caps in _captions("train"):
        kinds = {(o["colour"], o["shape"]) for o in objs}
        for t in caps:
            texts.append(t.lower())
            partial += len(parse(t)[0]) < len(kinds)
    assert partial > 0.5 * len(texts)
    joined = "\n".join(texts)
    for phrase in ["two ", "there is", "a photo of", " and ", "small", "large"]:
        assert phrase in joined, phrase
    assert sum(bool(parse(t)[1]) for t in texts) > 0.1 * len(texts)          # relations
    assert sum(parse(t)[0][0]["colour"] is None for t in texts) > 0          # colourless mentions


def test_reader_knows_every_relation_phrase_of_the_generator():
    from clipfinetune.sample.vocab import RELATIONS

    assert {p for phrases in RELATIONS.values() for p in phrases} <= set(RELATION)


def _docci():
    root = tiny_world()
    lines = [json.loads(x) for x in (root / "docci/descriptions.jsonlines").read_text().splitlines()]
    gt = [json.loads(x) for x in (root / "docci/lism_ground_truth.jsonl").read_text().splitlines()]
    return root, lines, gt


def _sentences(text):
    return re.split(r"(?<=\.)\s+", text.strip())


def test_docci_records_and_images():
    root, lines, _ = _docci()
    assert Counter(d["split"] for d in lines) == {"train": SMALL_WORLD["n_docci_train"],
                                                  "test": SMALL_WORLD["n_docci_test"]}
    for d in lines:
        assert set(d) == {"example_id", "split", "image_file", "description"}
        assert d["example_id"].startswith(d["split"]) and d["image_file"] == d["example_id"] + ".jpg"
        assert (root / "docci/images" / d["image_file"]).read_bytes() == \
            (root / "images/docci" / d["image_file"]).read_bytes()


def test_docci_sentences_describe_one_object_each_with_its_box():
    root, lines, gt = _docci()
    recs = scenes(root)
    by_id = {d["example_id"]: d for d in lines}
    seen = Counter()
    for row in gt:
        assert set(row) >= {"example_id", "sentence_index", "box"}
        objs = recs[f"images/docci/{row['example_id']}.jpg"]["objects"]
        sents = _sentences(by_id[row["example_id"]]["description"])
        assert 1 <= row["sentence_index"] < len(sents)
        sent = sents[row["sentence_index"]]
        (np_,) = parse(sent)[0]
        target = [o for o in objs if o["bbox"] == row["box"]]
        assert len(target) == 1 and caption_is_true(sent, target), (sent, target)
        o = target[0]
        assert (np_["colour"], np_["shape"], np_["size"]) == (o["colour"], o["shape"], o["size"])
        assert sum(caption_is_true(sent, [p]) for p in objs) == 1         # tells it apart
        size = recs[f"images/docci/{row['example_id']}.jpg"]["size"]
        row_i, col_i = min(2, int(3 * o["cy"] / size)), min(2, int(3 * o["cx"] / size))
        s = sent.lower()
        assert ("top" in s) == (row_i == 0) and ("bottom" in s) == (row_i == 2), (sent, o)
        assert ("left" in s) == (col_i == 0) and ("right" in s) == (col_i == 2), (sent, o)
        seen[row["example_id"]] += 1
    for d in lines:
        n = len(recs[f"images/docci/{d['example_id']}.jpg"]["objects"])
        assert seen[d["example_id"]] == n                               # every object described once
        first = _sentences(d["description"])[0].lower()
        assert parse(first)[2] == n and "background" in first          # summary sentence


def test_long_captions_exercise_truncation_and_the_sentence_cap():
    from open_clip.tokenizer import SimpleTokenizer

    _, lines, _ = _docci()
    tok = SimpleTokenizer()
    lengths = [len(tok.encode(d["description"])) + 2 for d in lines]         # + SOT/EOT
    n_sents = [len(_sentences(d["description"])) for d in lines]
    assert sum(n > 77 for n in lengths) >= 0.3 * len(lines) and min(lengths) <= 77
    assert sum(n > 15 for n in n_sents) >= 1 and max(n_sents) <= 20


@pytest.mark.parametrize("kind", KINDS)
def test_sugarcrepe_negatives_are_false_for_their_image(kind):
    root = tiny_world()
    recs = scenes(root)
    cases = json.loads((root / f"sugarcrepe/{kind}.json").read_text())
    assert len(cases) == SMALL_WORLD["n_compositional"] and all(k.isdigit() for k in cases)
    for case in cases.values():
        assert set(case) == {"filename", "caption", "negative_caption"}
        assert (root / "images/val" / case["filename"]).exists()
        objs = recs[f"images/val/{case['filename']}"]["objects"]
        pos, neg = case["caption"], case["negative_caption"]
        assert pos != neg
        assert caption_is_true(pos, objs), (kind, pos, objs)
        assert not caption_is_true(neg, objs), (kind, neg, objs)
        assert len(parse(neg)[0]) == shape_words(neg)


def test_aro_relation_cases():
    root = tiny_world()
    recs = scenes(root)
    cases = json.loads((root / "aro/visual_genome_relation.json").read_text())
    assert len(cases) == SMALL_WORLD["n_compositional"]
    assert len({c["relation_name"] for c in cases}) >= 4
    for c in cases:
        assert {"image_path", "bbox_x", "bbox_y", "bbox_w", "bbox_h", "relation_name", "true_caption",
                "false_caption"} <= set(c)
        assert c["relation_name"] in RELATION and c["relation_name"] not in SYMMETRIC
        assert f" {c['relation_name']} " in c["true_caption"]
        rec = recs[f"aro/images/{c['image_path']}"]
        _check_aro_case(c, rec)


def test_aro_attribution_cases_have_25_per_pair():
    root = tiny_world()
    recs = scenes(root)
    cases = json.loads((root / "aro/visual_genome_attribution.json").read_text())
    assert len(cases) == SMALL_WORLD["n_compositional"]
    pairs = Counter(f"{c['attributes'][0]}_{c['attributes'][1]}" for c in cases)
    assert min(pairs.values()) >= 25
    for c in cases:
        nps = parse(c["true_caption"])[0]
        assert [n["colour"] for n in nps] == c["attributes"]
        _check_aro_case(c, recs[f"aro/images/{c['image_path']}"])


def _check_aro_case(c, rec):
    objs, size = rec["objects"], rec["size"]
    assert caption_is_true(c["true_caption"], objs) and not caption_is_true(c["false_caption"], objs), c
    x0, y0, x1, y1 = c["bbox_x"], c["bbox_y"], c["bbox_x"] + c["bbox_w"], c["bbox_y"] + c["bbox_h"]
    assert 0 <= x0 < x1 <= size and 0 <= y0 < y1 <= size
    for np_ in parse(c["true_caption"])[0]:
        (o,) = [o for o in objs if (o["colour"], o["shape"]) == (np_["colour"], np_["shape"])]
        assert x0 <= o["bbox"][0] and o["bbox"][2] <= x1 and y0 <= o["bbox"][1] and o["bbox"][3] <= y1
