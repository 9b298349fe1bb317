"""The `rules` backend of the `negatives` stage: DeGLA's five rewrite types without an LLM.

The sample world's default (no LLM exists on a CPU-only machine), and the documented fallback the
stage metadata names. Each answer is a deterministic function of (seed, caption, type, variant):

- `reshuffle`: noun chunks kept whole, the units (chunks and the other words) shuffled until the
  order changes; a caption that is a single chunk ("two green triangles") is shuffled word by word;
  trailing punctuation stays at the end;
- `swap_nouns` / `swap_adjectives`: two targeted words with different text trade places, preferring
  words in different noun chunks ("a large *red* circle ... a small *blue* square");
- `replace_nouns` / `replace_adjectives`: one targeted word is replaced by a word of the same part of
  speech that the caption corpus itself uses (the LLM would stay in-domain too), preferring WordNet
  antonyms and co-hyponyms (`rule_negatives.replacement_candidates`) and never a synonym; inflected with
  pyinflect, casing kept. With no corpus word available it falls back to the WordNet candidates.
Spatial "fake nouns" ("left", "top") are neither swapped nor replaced.
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter

from clipfinetune.data.negatives.degla.validators import TYPES, is_adjective, is_noun
from clipfinetune.data.negatives.rules import (
    FAKE_NOUNS,
    antonym_names,
    inflect_like,
    is_synonym,
    parse,
    replacement_candidates,
    warm,
)

RULES_VERSION = "degla-rules-v1"


def _rng(seed: int, *parts) -> random.Random:
    h = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


def _lemma(word: str, pos: str) -> str:
    from clipfinetune.resources import wordnet

    return wordnet().morphy(word.lower(), pos) or word.lower()


class RulesBackend:
    """spaCy/WordNet generator of DeGLA's five types (no model)."""

    name = "rules"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.model = RULES_VERSION
        self.pool: dict[str, list[str]] = {"n": [], "a": []}

    def prepare(self, captions) -> None:
        """Parse the corpus once and collect its noun and adjective vocabulary (lemmas)."""
        captions = list(captions)
        warm(captions)
        counts = {"n": Counter(), "a": Counter()}
        for c in dict.fromkeys(captions):
            for t in parse(c):
                if t.lower_ in FAKE_NOUNS or not t.is_alpha:
                    continue
                if is_adjective(t):
                    counts["a"][_lemma(t.text, "a")] += 1
                elif is_noun(t) and t.dep_ != "compound":
                    counts["n"][_lemma(t.text, "n")] += 1
        # a word the parser calls an adjective at least as often as a noun ("green") is no noun
        counts["n"] = Counter({w: n for w, n in counts["n"].items() if n > counts["a"][w]})
        self.pool = {p: sorted(c) for p, c in counts.items()}

    def run(self, requests, on_result) -> None:
        for req in requests:
            text = self.answer(req.caption, req.type, req.variant)
            on_result(req, text, None if text else "no_candidate", text or "")

    def answer(self, caption: str, type_: str, variant: int = 0) -> str | None:
        if type_ not in TYPES:
            raise ValueError(f"unknown negative type {type_!r}")
        rng = _rng(self.seed, caption, type_, variant)
        doc = parse(caption)
        if type_ == "reshuffle":
            return _reshuffle(doc, rng)
        pred = is_noun if type_.endswith("nouns") else is_adjective
        targets = [t for t in doc if pred(t) and t.is_alpha and t.lower_ not in FAKE_NOUNS]
        if type_.startswith("swap"):
            return _swap(doc, targets, "n" if type_.endswith("nouns") else "a", rng)
        return self._replace(doc, targets, "n" if type_.endswith("nouns") else "a", rng)

    def _replace(self, doc, targets, pos: str, rng: random.Random) -> str | None:
        rng.shuffle(targets)
        for tok in targets:
            lemma = _lemma(tok.text, pos)
            related = set(replacement_candidates(lemma, pos)[0])
            pool = [w for w in self.pool[pos] if w != lemma and not is_synonym(w, lemma, pos)]
            choices = ([w for w in pool if w in antonym_names(lemma, pos)] or [w for w in pool if w in related]
                       or pool or [w for w in replacement_candidates(lemma, pos)[0] if "_" not in w])
            if choices:
                new = inflect_like(rng.choice(choices), tok.text, tok.tag_)
                if new.lower() != tok.lower_:
                    return doc.text[:tok.idx] + new + doc.text[tok.idx + len(tok):]
        return None


def _swap(doc, targets, pos: str, rng: random.Random) -> str | None:
    """Two targeted words with different text and meaning (no WordNet synonyms). Preferred: words in
    different chunks at the same distance from their head noun ("a large *red* circle ... a small
    *blue* square"), then WordNet-related ones (red/blue, large/small), then any cross-chunk pair."""
    chunk_of = {t.i: k for k, ch in enumerate(doc.noun_chunks) for t in ch}
    lem = {t.i: _lemma(t.text, pos) for t in targets}
    pairs = [(a, b) for i, a in enumerate(targets) for b in targets[i + 1:]
             if a.lower_ != b.lower_ and not is_synonym(lem[a.i], lem[b.i], pos)]

    def rank(pair):
        a, b = pair
        cross = chunk_of.get(a.i, -1 - a.i) != chunk_of.get(b.i, -1 - b.i)
        same_slot = cross and pos == "a" and (a.head.i - a.i) == (b.head.i - b.i)
        related = pos == "a" and (lem[b.i] in antonym_names(lem[a.i], pos)
                                  or lem[b.i] in set(replacement_candidates(lem[a.i], pos)[0]))
        return (same_slot, cross and related, cross)

    if pairs:
        best = max(map(rank, pairs))
        pairs = [p for p in pairs if rank(p) == best]
    if not pairs:
        return None
    a, b = pairs[rng.randrange(len(pairs))]
    text = doc.text
    return (text[:a.idx] + b.text + text[a.idx + len(a):b.idx] + a.text + text[b.idx + len(b):])


def _reshuffle(doc, rng: random.Random) -> str | None:
    toks = [t for t in doc if not t.is_space]
    tail = []
    while toks and toks[-1].is_punct:
        tail.insert(0, toks.pop())
    in_chunk = {t.i: ch for ch in doc.noun_chunks for t in ch}
    units, seen = [], set()
    for t in toks:
        ch = in_chunk.get(t.i)
        if ch is None:
            units.append(t.text)
        elif ch.start not in seen:
            seen.add(ch.start)
            units.append(ch.text)
    if len(units) < 2:
        units = [t.text for t in toks]
    if len(set(units)) < 2:
        return None
    original = list(units)
    for _ in range(10):
        rng.shuffle(units)
        if units != original:
            return " ".join(units) + "".join(t.text for t in tail)
    return None
