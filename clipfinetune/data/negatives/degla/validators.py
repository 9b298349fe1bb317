"""Validators for DeGLA's five rewrite types: is a reply a usable hard negative of its type?

Every reply from every backend (LLM or rules) goes through `check(original, reply, type)`, which
returns None for a valid negative or a short reject reason (counted in the stage's metadata):

- common: `empty`, `multiline`, `unchanged` (same word sequence as the caption, case and punctuation
  ignored), `over_long` (more than max(2n, n + 8) words for an n-word caption);
- `reshuffle`: the same multiset of words in a different order, else `not_a_permutation`;
- `swap_nouns` / `swap_adjectives`: the same multiset of words (`not_a_permutation`), and with the
  caption's nouns (adjectives) removed both sequences are identical (`changed_other_words`): only the
  targeted words moved; a caption with fewer than two distinct targeted words gives `no_target`;
- `replace_nouns` / `replace_adjectives`: word-level diff against the caption; every changed stretch
  replaces caption words of the targeted part of speech (`changed_other_words`; pure insertions or
  deletions are `inserted_or_deleted`) by words WordNet knows in that part of speech
  (`wrong_part_of_speech`); a one-for-one replacement sharing a WordNet synset with the old word is
  `synonym`; a reply that only moves words around is `not_a_replacement`. "a"/"an" are treated alike.

Parts of speech of the caption come from spaCy (`rule_negatives.parse`, cached); an adjective is a token
tagged ADJ or attached as `amod` (en_core_web_sm tags "green" PROPN now and then); a noun is a
NOUN/PROPN token that is not an adjective. The reply is only tokenised (no parse): its new words are
checked against WordNet, which is cheaper and does not depend on the parser's mood on a broken sentence.
"""
from __future__ import annotations

import difflib
from collections import Counter

from clipfinetune.data.negatives.rules import is_synonym, nlp, parse, synset_names

TYPES = ("reshuffle", "swap_nouns", "swap_adjectives", "replace_adjectives", "replace_nouns")
RULES = {  # DeGLA Table 1, verbatim
    "reshuffle": "Reshuffle the overall order of the sentence",
    "swap_nouns": "Swap the nouns in the sentence",
    "swap_adjectives": "Swap the adjectives in the sentence",
    "replace_adjectives": "Replace the adjectives in the sentence",
    "replace_nouns": "Replace the nouns in the sentence",
}
_TARGET = {"swap_nouns": "n", "replace_nouns": "n", "swap_adjectives": "a", "replace_adjectives": "a"}


def is_adjective(tok) -> bool:
    return tok.pos_ == "ADJ" or (tok.dep_ == "amod" and tok.pos_ in ("PROPN", "NOUN", "VERB"))


def is_noun(tok) -> bool:
    return tok.pos_ in ("NOUN", "PROPN") and not is_adjective(tok)


def _norm(w: str) -> str:
    return "a" if w == "an" else w


def caption_words(caption: str) -> list[tuple[str, str | None]]:
    """(lower-cased word, 'n' | 'a' | None) for every non-punctuation token of the caption."""
    return [(_norm(t.lower_), "n" if is_noun(t) else "a" if is_adjective(t) else None)
            for t in parse(caption) if not (t.is_punct or t.is_space)]


def reply_words(reply: str) -> list[str]:
    return [_norm(t.lower_) for t in nlp().tokenizer(reply) if not (t.is_punct or t.is_space)]


def check(original: str, reply, type_: str) -> str | None:
    """None if `reply` is a valid `type_` negative of `original`, else the reject reason."""
    if type_ not in TYPES:
        raise ValueError(f"unknown negative type {type_!r}; expected one of {TYPES}")
    if not isinstance(reply, str) or not reply.strip():
        return "empty"
    if "\n" in reply.strip():
        return "multiline"
    tagged = caption_words(original)
    ow, rw = [w for w, _ in tagged], reply_words(reply)
    if not rw:
        return "empty"
    if rw == ow:
        return "unchanged"
    if len(rw) > max(2 * len(ow), len(ow) + 8):
        return "over_long"
    if type_ == "reshuffle":
        return None if Counter(rw) == Counter(ow) else "not_a_permutation"
    pos = _TARGET[type_]
    targets = {w for w, p in tagged if p == pos}
    if type_.startswith("swap"):
        if len(targets) < 2:
            return "no_target"
        if Counter(rw) != Counter(ow):
            return "not_a_permutation"
        keep = lambda ws: [w for w in ws if w not in targets]
        return None if keep(ow) == keep(rw) else "changed_other_words"
    return _check_replacement(tagged, rw, pos)


def _check_replacement(tagged, rw: list[str], pos: str) -> str | None:
    ow = [w for w, _ in tagged]
    if not any(p == pos for _, p in tagged):
        return "no_target"
    if Counter(rw) == Counter(ow):
        return "not_a_replacement"
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=ow, b=rw, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        if op != "replace":
            return "inserted_or_deleted"
        if any(p != pos for _, p in tagged[i1:i2]):
            return "changed_other_words"
        if any(not synset_names(w, pos) for w in rw[j1:j2]):
            return "wrong_part_of_speech"
        if i2 - i1 == 1 and j2 - j1 == 1 and is_synonym(ow[i1], rw[j1], pos):
            return "synonym"
    return None
