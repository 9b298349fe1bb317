"""DeGLA negatives: validators, few-shot bank, rules backend, merge to K = 4, cache, caption loading."""
import json
import random
from collections import Counter

import pytest

from clipfinetune.data.negatives.degla.cache import AnswerCache
from clipfinetune.data.negatives.degla.generate import COLUMNS, caption_records, generate_negatives
from clipfinetune.data.negatives.degla.llm import N_EXAMPLES, build_prompt, fewshot_bank
from clipfinetune.data.negatives.degla.rules_backend import RulesBackend
from clipfinetune.data.negatives.degla.validators import TYPES, check
from clipfinetune.data.readers import coco
from clipfinetune.io import InputError

CAP = "a large red circle to the left of a small blue square"


def sample_like_captions(n=120, seed=0):
    """Captions shaped like the sample world's: one or two coloured shapes, sizes, spatial relations."""
    rng = random.Random(seed)
    c = rng.choice
    colors = ["red", "blue", "green", "yellow", "purple", "orange"]
    sizes, shapes = ["large", "small", "big", "tiny"], ["circle", "square", "triangle", "star", "hexagon"]
    rels = ["to the left of", "to the right of", "above", "below", "next to"]
    out = {"a large red circle to the left of a small blue square", "two green triangles"}
    while len(out) < n:
        r = rng.random()
        if r < 0.2:
            out.add(f"{c(['two', 'three'])} {c(colors)} {c(shapes)}s")
        elif r < 0.3:
            out.add(f"a {c(sizes)} {c(colors)} {c(shapes)}")
        else:
            out.add(f"a {c(sizes)} {c(colors)} {c(shapes)} {c(rels)} a {c(sizes)} {c(colors)} {c(shapes)}")
    return sorted(out)


@pytest.mark.parametrize("type_,reply", [
    ("reshuffle", "a small blue square to the left of a large red circle"),
    ("swap_nouns", "a large red square to the left of a small blue circle"),
    ("swap_adjectives", "a large blue circle to the left of a small red square"),
    ("replace_adjectives", "a large green circle to the left of a small blue square"),
    ("replace_nouns", "a large red triangle to the left of a small blue square"),
])
def test_validator_accepts_a_good_negative_of_each_type(type_, reply):
    assert check(CAP, reply, type_) is None


@pytest.mark.parametrize("type_,reply,reason", [
    ("reshuffle", "", "empty"),
    ("reshuffle", CAP.upper() + ".", "unchanged"),
    ("replace_nouns", " ".join([CAP] * 4), "over_long"),
    ("reshuffle", "a small blue square to the left of a large red triangle", "not_a_permutation"),
    ("swap_nouns", "a small blue square to the left of a large red circle", "changed_other_words"),
    ("swap_adjectives", "a large red square to the left of a small blue circle", "changed_other_words"),
    ("replace_nouns", "a large green circle to the left of a small blue square", "changed_other_words"),
    ("replace_adjectives", "a big red circle to the left of a small blue square", "synonym"),
    ("replace_nouns", "a large red square to the left of a small blue circle", "not_a_replacement"),
    ("replace_nouns", "a large red circle to the left of a small blue square with a dog", "inserted_or_deleted"),
    ("replace_nouns", "a large red quickly to the left of a small blue square", "wrong_part_of_speech"),
    ("swap_nouns", "triangles two green", "no_target"),
])
def test_validator_rejects_with_the_reason(type_, reply, reason):
    caption = "two green triangles" if reason == "no_target" else CAP
    assert check(caption, reply, type_) == reason


def test_fewshot_bank_has_enough_valid_examples_per_type():
    bank = fewshot_bank()
    for t in TYPES:
        exs = bank[t]["examples"]
        assert len(exs) >= N_EXAMPLES
        for ex in exs:
            assert check(ex["input"], ex["output"], t) is None, (t, ex)


def test_prompt_follows_degla_structure():
    p = build_prompt(CAP, "swap_nouns")
    assert "Swap the nouns in the sentence" in p
    assert "significantly different or opposite meanings" in p
    assert p.count("Input text:") == N_EXAMPLES + 1 and CAP in p
    assert build_prompt(CAP, "swap_nouns", 1) != p     # a second answer sees other examples


@pytest.fixture(scope="module")
def rules_run(tmp_path_factory):
    caps = sample_like_captions()
    records = [{"image_id": str(i // 2), "caption_index": i % 2, "caption": c} for i, c in enumerate(caps)]
    path = tmp_path_factory.mktemp("cache") / "answers.jsonl"
    with AnswerCache(path) as cache:
        rows, stats = generate_negatives(records, RulesBackend(0), cache, "rules")
    return records, path, rows, stats


def test_rules_backend_reaches_90_percent_valid4(rules_run):
    _, _, rows, stats = rules_run
    assert stats["valid4_rate"] >= 90.0, stats
    assert stats["backend"] == "rules"
    per = Counter((r["image_id"], r["caption_index"]) for r in rows)
    assert max(per.values()) == 4


def test_rows_are_distinct_valid_negatives_of_their_type(rules_run):
    _, _, rows, _ = rules_run
    assert all(tuple(r) == COLUMNS for r in rows)
    groups = {}
    for r in rows:
        assert check(r["caption"], r["negative"], r["type"]) is None
        assert r["negative"].lower() != r["caption"].lower()
        groups.setdefault((r["image_id"], r["caption_index"]), []).append(r["negative"])
    assert all(len(set(v)) == len(v) for v in groups.values())
    swaps = Counter(r["type"] for r in rows if r["type"].startswith("swap"))
    assert swaps["swap_nouns"] and swaps["swap_adjectives"]      # the merged slot uses both subtypes


def test_second_run_asks_nothing_and_gives_the_same_rows(rules_run):
    records, path, rows, _ = rules_run
    with AnswerCache(path) as cache:
        rows2, stats2 = generate_negatives(records, RulesBackend(0), cache, "rules")
    assert stats2["requests_asked"] == 0 and stats2["answers_from_cache"] > 0
    assert rows2 == rows


def test_cache_survives_a_truncated_last_line(tmp_path):
    path = tmp_path / "a.jsonl"
    with AnswerCache(path) as c:
        c.append({"key": "k1", "text": "x"})
    with open(path, "ab") as f:
        f.write(b'{"key": "k2", "te')           # a killed writer
    with AnswerCache(path) as c:
        assert c.corrupt_lines == 1 and "k1" in c and "k2" not in c
        c.append({"key": "k3", "text": "z"})
    c = AnswerCache(path)
    assert "k1" in c and "k3" in c and c.corrupt_lines == 1


def test_caption_records_take_the_coco_readers_caption_index_and_name_bad_records(tmp_path):
    f = tmp_path / "captions_train.json"
    images = [{"id": 7, "file_name": "7.jpg", "width": 4, "height": 4}]
    f.write_text(json.dumps({"images": images, "annotations": [
        {"id": 1, "image_id": 7, "caption": "a red circle"}, {"id": 2, "image_id": 7, "caption": " "},
        {"id": 4, "image_id": 7, "caption": "a  blue square"}]}))
    counts = Counter()
    recs = caption_records(coco.read(f, tmp_path, counts=counts))
    assert [(r["image_id"], r["caption_index"], r["caption"]) for r in recs] == \
        [("7", 0, "a red circle"), ("7", 1, "a blue square")]
    assert counts == {"empty_captions_skipped": 1}
    f.write_text(json.dumps({"images": images, "annotations": [{"id": 3, "caption": "no image"}]}))
    with pytest.raises(InputError, match=r"captions_train\.json.*3.*image_id"):
        coco.read(f, tmp_path)
    with pytest.raises(InputError, match="missing.json"):
        coco.read(tmp_path / "missing.json", tmp_path)
