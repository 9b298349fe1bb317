"""FSC-CLIP online rule negatives: each rule's defining property on crafted captions."""
import difflib
import random
import re
from collections import Counter

import pytest

from clipfinetune.data.negatives.rules import NEGATIVE_TYPES, online_negatives
from clipfinetune.resources import wordnet

RICH = [
    "a large red circle to the left of a small blue square",
    "A man is riding a brown horse in the field.",
    "two green triangles and a purple circle",
    "a small yellow star above a big purple hexagon",
    "A black dog chases a white cat across the green lawn.",
]


def words(s):
    return re.findall(r"[\w']+", s.lower())


def many(caption, n=12, seed=0):
    rng = random.Random(seed)
    return [online_negatives(caption, rng) for _ in range(n)]


def test_returns_the_three_types():
    out = online_negatives(RICH[0], random.Random(0))
    assert set(out) == set(NEGATIVE_TYPES) == {"negclip", "replace", "shuffle"}


@pytest.mark.parametrize("caption", RICH)
def test_negclip_swap_keeps_the_multiset_of_words(caption):
    for out in many(caption):
        neg = out["negclip"]
        assert neg is not None and neg != caption
        assert Counter(words(neg)) == Counter(words(caption))


@pytest.mark.parametrize("caption", RICH)
def test_shuffle_changes_order_and_keeps_words(caption):
    for out in many(caption):
        neg = out["shuffle"]
        assert neg is not None
        assert Counter(words(neg)) == Counter(words(caption))
        assert words(neg) != words(caption)


@pytest.mark.parametrize("caption", RICH)
def test_replace_changes_one_element_to_a_non_synonym(caption):
    wn = wordnet()
    for out in many(caption):
        neg = out["replace"]
        assert neg is not None and neg != caption
        ops = [op for op in difflib.SequenceMatcher(a=words(caption), b=words(neg), autojunk=False).get_opcodes()
               if op[0] != "equal"]
        assert len(ops) == 1, (caption, neg)             # exactly one element replaced
        _, i1, i2, j1, j2 = ops[0]
        old, new = words(caption)[i1:i2], words(neg)[j1:j2]
        if len(old) == 1 and wn.synsets(old[0]):          # a WordNet word (not a preposition phrase)
            old_syn = set(wn.synsets(old[0]))
            new_syn = set(wn.synsets("_".join(new)))
            assert not old_syn & new_syn, f"{old} -> {new} are synonyms"


def test_negatives_are_fresh_at_every_call():
    outs = many(RICH[1], n=30)
    for t in NEGATIVE_TYPES:
        assert len({o[t] for o in outs}) > 1, t


def test_same_rng_state_gives_same_negatives():
    assert many(RICH[0], seed=3) == many(RICH[0], seed=3)


def test_caption_without_material_returns_none():
    out = online_negatives("two green triangles", random.Random(0))
    assert out["negclip"] is None      # one noun, one adjective, one chunk: nothing to swap
    assert out["replace"] is None      # one entity: the scene-graph filter rejects it
    assert out["shuffle"] is not None  # two bi-grams can still be shuffled
    assert all(v is None for v in online_negatives("dog", random.Random(0)).values())
    assert online_negatives("dog.", random.Random(0))["shuffle"] is None   # word + punctuation only


def test_replace_keeps_inflection_and_casing():
    rng = random.Random(1)
    for _ in range(20):
        neg = online_negatives("Three dogs chase two cats in a garden.", rng)["replace"]
        assert neg[0].isupper()
        changed = set(words(neg)) - set(words("Three dogs chase two cats in a garden."))
        if changed & {w for w in changed if wordnet().synsets(w, "n")} and "dogs" not in neg:
            assert any(w.endswith("s") for w in changed) or " " in neg  # the plural survives


def test_captions_naming_the_same_word_share_its_weighted_candidates():
    # memory: every caption's replaceable element used to carry its own tuple of cumulative weights (thousands of
    # co-hyponyms each), and a loader worker grew by ~0.2 GB per 1,400 captions; one tuple per word is enough
    import itertools

    from clipfinetune.data.negatives import rules

    a = rules._analyse("a red dog sitting on a blue chair")
    b = rules._analyse("a green dog standing next to the table")
    dog_a = next(e for e in a.elements if e.text == "dog")
    dog_b = next(e for e in b.elements if e.text == "dog")
    assert dog_a.cum_weights is dog_b.cum_weights and dog_a.candidates is dog_b.candidates
    names, weights = rules.replacement_candidates("dog", "n")
    assert dog_a.candidates == names
    assert dog_a.cum_weights == tuple(itertools.accumulate(weights))
