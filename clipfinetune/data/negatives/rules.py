"""FSC-CLIP's online rule-based hard negatives: negclip swap, WordNet replace, bi-gram shuffle.

The recipe is CLoVe's (`Netflix/clove`, mirrored by `ytaek-oh/fsc-clip`
`src/training/text_negatives/`), as fixed in docs/methods.md §0.2, §2.2 and §6.5. Our code is our own; where
it departs from the public code it says so:

- **negclip**: six span lists (noun chunks > 2 tokens, verb phrases `VERB? ADV* AUX* VERB+`, NN, NNS,
  ADV, ADJ), each through `spacy.util.filter_spans`; up to 2 spans sampled per list (a list of <= 2
  spans is taken as is, like CLoVe's `sample_up_to_k`), kept when their texts differ; one pair over all
  lists swaps places by character offsets.
- **replace**: a scene graph built from spaCy's parse following `sng_parser`'s spaCy backend (entities =
  noun chunks without pronouns or spatial "fake nouns"; modifiers = det/nummod/amod children with
  conjunctions flattened; relations from the same dependency rules, with a small built-in phrasal
  preposition list standing in for sng_parser's database). Filter: >= 2 entities and (>= 1 relation or
  modifier). Candidates per element: antonyms and sibling/cousin co-hyponyms from WordNet (adjectives
  routed through derivationally related nouns), weights `max(lemma.count(), 1)`; prepositions draw
  from a fixed list. Differences: (1) CLoVe's Google-ngram preposition frequencies are not available
  here, so preposition weights are a Zipf prior over our own frequency ranking (`_PREPOSITIONS`);
  (2) "no synonyms" is enforced by lemma *name*: a candidate whose any synset (same POS) is a synset of
  the original word is dropped (CLoVe compares Lemma objects, which lets a synonym through when it
  appears in a co-hyponym synset too). Up to 2 candidates per element (weighted, without
  replacement), one negative drawn uniformly; inflection by pyinflect, `_` -> space, casing kept.
- **shuffle**: consecutive non-overlapping bi-grams of spaCy tokens, a lone trailing punctuation held
  out and re-inserted at a random boundary, 10 retries against "unchanged once boundary punctuation is
  ignored". Difference: the check compares token sequences directly instead of re-parsing the
  shuffled string with spaCy (same outcome for shuffles of whole tokens, far cheaper).

Speed: everything that depends only on the caption (parse, span lists, scene graph, WordNet candidate
lists) is cached per process with `functools.lru_cache`; each call only samples with the caller's rng,
so negatives are fresh at every call. Loader workers each warm their own cache.
"""
from __future__ import annotations

import bisect
import functools
import itertools
import random
from dataclasses import dataclass

from clipfinetune.resources import load_spacy, wordnet

NEGATIVE_TYPES = ("negclip", "replace", "shuffle")
MAX_SHUFFLE_RETRY = 10
CACHE_SIZE = 1 << 16

# sng_parser treats these as parts of a phrasal preposition ("to the left of"), not as entities.
FAKE_NOUNS = frozenset({"left", "right", "front", "back", "top", "bottom", "side", "middle", "center",
                        "centre", "edge", "corner", "behind", "inside", "outside", "rear"})
_PHRASAL_PREPS = frozenset({
    "to the left of", "to the right of", "on the left of", "on the right of", "in front of",
    "in back of", "on top of", "at the top of", "at the bottom of", "on the side of", "at the side of",
    "in the middle of", "in the center of", "in the centre of", "on the edge of", "at the edge of",
    "on the left side of", "on the right side of", "to the side of", "in the corner of", "on the back of",
})
# Our own frequency ranking of English prepositions (most frequent first); weight = Zipf prior 1000/rank.
_PREPOSITIONS = (
    "of", "in", "to", "for", "with", "on", "at", "from", "by", "as", "into", "like", "through", "after",
    "over", "between", "out", "against", "during", "without", "before", "under", "around", "among",
    "up", "within", "along", "across", "behind", "beyond", "down", "near", "above", "toward", "off",
    "upon", "below", "outside", "inside", "past", "beside", "next to", "in front of", "on top of",
    "onto", "towards", "beneath", "underneath", "alongside", "opposite", "atop", "amid", "throughout",
    "aboard", "amongst", "unlike", "besides", "following", "including", "until", "since", "till",
    "unto", "thru", "nearer", "nearest", "amidst", "in addition to", "in spite of", "on account of",
    "with regard to", "in regard to", "in reference to", "on the side of", "on side of",
)
_WN_POS = {"NOUN": "n", "PRON": "n", "PROPN": "n", "VERB": "v", "ADJ": "a", "ADV": "r"}


@dataclass(frozen=True)
class _Element:  # one replaceable scene-graph element
    start: int
    end: int
    text: str
    tag: str
    candidates: tuple[str, ...]
    cum_weights: tuple[float, ...]


@dataclass(frozen=True)
class _Analysis:  # everything about a caption that does not depend on the rng
    text: str
    swap_lists: tuple[tuple[tuple[int, int, str], ...], ...]
    elements: tuple[_Element, ...] | None        # None: the replace filter rejects the caption
    tokens: tuple[tuple[str, bool, str], ...]    # (text, is_punct, trailing whitespace)


@functools.lru_cache(maxsize=1)
def nlp():
    """spaCy pipeline without NER and lemmatizer (no rule uses them; ~30% faster)."""
    return load_spacy(("ner", "lemmatizer"))


@functools.lru_cache(maxsize=1)
def _vp_matcher():
    from spacy.matcher import Matcher

    m = Matcher(nlp().vocab)
    m.add("VP", [[{"POS": "VERB", "OP": "?"}, {"POS": "ADV", "OP": "*"}, {"POS": "AUX", "OP": "*"},
                  {"POS": "VERB", "OP": "+"}]])
    return m


_DOCS: dict = {}


def parse(caption: str):
    """Cached spaCy Doc of a caption (shared with the DeGLA rules backend and validators)."""
    doc = _DOCS.get(caption)
    if doc is None:
        if len(_DOCS) >= CACHE_SIZE:
            _DOCS.clear()
        doc = _DOCS[caption] = nlp()(caption)
    return doc


def warm(captions, batch_size: int = 256) -> None:
    """Parse many captions at once with `nlp.pipe` (about 2x faster than one by one) into the cache."""
    todo = list(dict.fromkeys(c for c in captions if c not in _DOCS))[:CACHE_SIZE]
    for caption, doc in zip(todo, nlp().pipe(todo, batch_size=batch_size)):
        if len(_DOCS) >= CACHE_SIZE:
            _DOCS.clear()
        _DOCS[caption] = doc


def online_negatives(caption: str, rng: random.Random) -> dict[str, str | None]:
    """FSC-CLIP's three rule negatives for one caption, freshly sampled with `rng`.

    Returns {"negclip": str|None, "replace": str|None, "shuffle": str|None}; None when the caption
    yields no negative of that type (the loss masks it out, docs/methods.md §6.2).
    """
    a = _analyse(caption)
    return {"negclip": _negclip(a, rng), "replace": _replace(a, rng), "shuffle": _shuffle(a, rng)}


# ---------------------------------------------------------------- analysis (cached per caption)
@functools.lru_cache(maxsize=CACHE_SIZE)
def _analyse(caption: str) -> _Analysis:
    import spacy.util

    doc = parse(caption)
    one = lambda pred: [doc[t.i:t.i + 1] for t in doc if pred(t)]
    lists = ([c for c in doc.noun_chunks if len(c) > 2], list(_vp_matcher()(doc, as_spans=True)),
             one(lambda t: t.tag_ == "NN"), one(lambda t: t.tag_ == "NNS"),
             one(lambda t: t.pos_ == "ADV"), one(lambda t: t.pos_ == "ADJ"))
    swap_lists = tuple(tuple((s.start_char, s.end_char, s.text) for s in spacy.util.filter_spans(spans))
                       for spans in lists)
    tokens = tuple((t.text, t.pos_ == "PUNCT", t.whitespace_) for t in doc)
    return _Analysis(caption, tuple(s for s in swap_lists if len(s) >= 2), _replace_elements(doc), tokens)


def scene_graph(doc):
    """(entities, relations) after sng_parser's spaCy backend: entities are noun-chunk spans with their
    modifier tokens; relations are spans (a verb, a preposition or a phrasal preposition)."""
    relation_subj = {}
    for t in doc:
        if t.dep_ == "nsubj":
            relation_subj[t.head.i] = t.i
        elif t.dep_ == "acl":
            relation_subj[t.i] = t.head.i
        elif t.dep_ == "pobj" and t.head.dep_ == "agent" and t.head.head.pos_ == "VERB":
            relation_subj[t.head.head.i] = t.i
    relations, fake = [], set()
    for chunk in doc.noun_chunks:
        r, prep = chunk.root, chunk.root.head
        span = None
        if r.dep_ in ("dobj", "attr") and prep.i in relation_subj or r.dep_ == "nsubjpass" and prep.i in relation_subj:
            span = doc[prep.i:prep.i + 1]
        elif r.dep_ == "pobj" and prep.dep_ != "agent":
            hh = prep.head
            phrase = doc[hh.head.i:prep.i + 1].text.lower() if hh.dep_ == "pobj" else ""
            if phrase in _PHRASAL_PREPS or (hh.dep_ == "pobj" and hh.lower_ in FAKE_NOUNS):
                fake.add(hh.i)
                span = doc[hh.head.i:prep.i + 1]
            elif hh.dep_ in ("amod", "advmod") and hh.head.pos_ in ("NOUN", "VERB", "PROPN"):
                span = doc[hh.i:prep.i + 1]                    # "next to"
            elif hh.pos_ in ("NOUN", "PROPN", "VERB", "AUX") or hh.dep_ == "acl":
                span = doc[prep.i:prep.i + 1]
        if span is not None:
            relations.append((span, r))
    relations = [s for s, obj in relations if obj.i not in fake and obj.lower_ not in FAKE_NOUNS]
    entities = []
    for chunk in doc.noun_chunks:
        if chunk.root.pos_ == "PRON" or chunk.root.i in fake or chunk.root.lower_ in FAKE_NOUNS:
            continue
        mods = []
        for x in chunk.root.children:
            if x.dep_ in ("det", "nummod"):
                mods.append(x)
            elif x.dep_ == "amod":
                mods.extend([x] + [c for c in x.children if c.dep_ == "conj"])
        entities.append((chunk, mods))
    return entities, relations


def _replace_elements(doc) -> tuple[_Element, ...] | None:
    entities, relations = scene_graph(doc)
    if len(entities) < 2 or not (relations or any(m for _, m in entities)):
        return None
    out = []
    for item in itertools.chain((e.root for e, _ in entities), (m for _, ms in entities for m in ms),
                                relations):
        root = item.root if hasattr(item, "root") else item
        if root.pos_ == "ADP":
            start, end, text = item.start_char, item.end_char, item.text
            cands, cum_weights = _element_candidates(text.lower(), None)
        else:
            pos = _WN_POS.get(root.pos_)
            if pos is None:
                continue
            start, end, text = root.idx, root.idx + len(root), root.text
            cands, cum_weights = _element_candidates(root.lower_, pos)
        if cands:
            out.append(_Element(start, end, text, root.tag_, cands, cum_weights))
    return tuple(out)


@functools.cache
def _element_candidates(word: str, pos: str | None) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """(candidates, cumulative weights) of a word (pos None: a preposition), built once per word and shared by
    every caption's element: a tuple of cumulative weights per element (thousands of co-hyponyms each) made a
    loader worker grow by ~0.2 GB per 1,400 captions."""
    cands, weights = _preposition_candidates(word) if pos is None else replacement_candidates(word, pos)
    return cands, tuple(itertools.accumulate(weights))


# ---------------------------------------------------------------- WordNet candidates (cached per word)
def _antonyms(synset):
    for lemma in synset.lemmas():
        yield from lemma.antonyms()


def _cousins(synset):
    """Sibling or cousin co-hyponyms: synset -> parent -> grandparent -> children -> children."""
    for parent in synset.hypernyms():
        for grand in parent.hypernyms():
            for uncle in grand.hyponyms():
                for cousin in uncle.hyponyms():
                    if cousin != synset:
                        yield from cousin.lemmas()


def _cousins_of_adjective(synset):
    """Adjectives have no hypernyms: go through derivationally related nouns and back (CLoVe)."""
    nouns = {r.synset() for lemma in synset.lemmas() for r in lemma.derivationally_related_forms()
             if r.synset().pos() == "n"}
    for noun in sorted(nouns, key=lambda s: s.name()):
        for lemma in _cousins(noun):
            for r in lemma.derivationally_related_forms():
                if r.synset() != synset and r.synset().pos() in ("a", "s"):
                    yield r


@functools.lru_cache(maxsize=1)
def _sense_counts() -> dict[str, int]:
    """index.sense read once (NLTK's `Lemma.count()` binary-searches the file on every call: ~2 ms each)."""
    counts = {}
    with wordnet().open("index.sense") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                counts[parts[0]] = int(parts[3])
    return counts


def _lemma_count(lemma) -> int:
    return max(_sense_counts().get(lemma.key(), 0), 1)


@functools.cache
def synset_names(word: str, pos: str | None) -> frozenset[str]:
    """Names of the synsets of `word` (any inflection) for a WordNet POS ('a' includes satellites; None: all)."""
    return frozenset(s.name() for s in wordnet().synsets(word, pos=pos))


def is_synonym(a: str, b: str, pos: str | None = None) -> bool:
    """True when the two words are the same or share any WordNet synset (of any part of speech: stricter
    than CLoVe's same-POS test, so "circle"/"ring", which share a verb sense, never pass)."""
    a, b = a.lower().replace(" ", "_"), b.lower().replace(" ", "_")
    return a == b or bool(synset_names(a, None) & synset_names(b, None))


@functools.cache
def _synonym_names(word: str) -> frozenset[str]:
    """Lower-cased lemma names of every synset (any POS) of `word`, the word itself included."""
    return frozenset({word.lower()} | {name.lower() for s in wordnet().synsets(word) for name in s.lemma_names()})


@functools.cache
def replacement_candidates(word: str, pos: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Antonyms and sibling/cousin co-hyponyms of every sense of `word`, synonyms removed.

    Returns (lemma names, weights) in a deterministic order; weight = summed max(lemma.count(), 1).
    """
    wn = wordnet()
    weights: dict[str, int] = {}
    for synset in wn.synsets(word, pos=pos):
        cousins = _cousins_of_adjective(synset) if synset.pos() in ("a", "s") else _cousins(synset)
        for lemma in itertools.chain(_antonyms(synset), cousins):
            weights[lemma.name()] = weights.get(lemma.name(), 0) + _lemma_count(lemma)
    synonyms = _synonym_names(word)
    names = sorted(n for n in weights if n.lower() not in synonyms)
    return tuple(names), tuple(weights[n] for n in names)


@functools.cache
def antonym_names(word: str, pos: str) -> frozenset[str]:
    """WordNet antonyms of any sense of `word`."""
    return frozenset(a.name() for s in wordnet().synsets(word, pos=pos) for a in _antonyms(s))


@functools.cache
def _preposition_candidates(prep: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
    pairs = [(p, 1000.0 / rank) for rank, p in enumerate(_PREPOSITIONS, 1) if p != prep]
    return tuple(p for p, _ in pairs), tuple(w for _, w in pairs)


def inflect_like(new: str, text: str, tag: str) -> str:
    """`new` inflected to the Penn tag of the replaced token, underscores to spaces, casing copied."""
    import pyinflect

    new = (pyinflect.getInflection(new, tag=tag, inflect_oov=False) or [new])[0].replace("_", " ")
    if text.isupper() and len(text) > 1:
        return new.upper()
    if text[:1].isupper():
        return new[:1].upper() + new[1:]
    return new


# ---------------------------------------------------------------- the three generators (per call)
def _negclip(a: _Analysis, rng: random.Random) -> str | None:
    pairs = []
    for spans in a.swap_lists:
        chosen = rng.sample(spans, 2) if len(spans) > 2 else spans
        if chosen[0][2] != chosen[1][2]:
            pairs.append(tuple(sorted(chosen)))
    if not pairs:
        return None
    (s1, e1, t1), (s2, e2, t2) = pairs[rng.randrange(len(pairs))]
    return a.text[:s1] + t2 + a.text[e1:s2] + t1 + a.text[e2:]


def _weighted_sample(cum: tuple[float, ...], k: int, rng: random.Random) -> list[int]:
    """k distinct indices drawn with probability proportional to weight, without replacement."""
    k, picked, total = min(k, len(cum)), [], cum[-1]
    while len(picked) < k:
        i = bisect.bisect_right(cum, rng.random() * total)
        i = min(i, len(cum) - 1)
        if i not in picked:
            picked.append(i)
    return picked


def _replace(a: _Analysis, rng: random.Random) -> str | None:
    if not a.elements:
        return None
    options = [(el, el.candidates[i]) for el in a.elements for i in _weighted_sample(el.cum_weights, 2, rng)]
    el, new = options[rng.randrange(len(options))]
    if " " not in el.text:
        new = inflect_like(new, el.text, el.tag)
    else:
        new = new.replace("_", " ")
        new = new[:1].upper() + new[1:] if el.text[:1].isupper() else new
    return a.text[:el.start] + new + a.text[el.end:]


def _shuffle(a: _Analysis, rng: random.Random) -> str | None:
    toks = a.tokens
    grams = [list(toks[i:i + 2]) for i in range(0, len(toks), 2)]
    if len(grams) < 2:
        return None
    punct = None
    if len(grams[-1]) == 1 and grams[-1][0][1]:
        if len(grams) == 2:
            return None
        punct, grams = grams[-1][0], grams[:-1]
    original = _core(toks)
    for _ in range(MAX_SHUFFLE_RETRY):
        order = grams[:]
        rng.shuffle(order)
        order = [g[:] for g in order]
        if punct is not None:
            pos = rng.randint(0, len(order))
            if pos == 0:
                order.insert(0, [punct])
            else:
                order[pos - 1].append(punct)
        flat = [t for g in order for t in g]
        if _core(flat) != original:
            return " ".join("".join((" " if i and not t[1] else "") + t[0] for i, t in enumerate(g))
                            for g in order)
    return None


def _core(tokens) -> tuple[str, ...]:
    """Token texts without punctuation at either end (FSC-CLIP's "unchanged" test)."""
    n = len(tokens)
    return tuple(t[0] for i, t in enumerate(tokens) if not (i in (0, n - 1) and t[1]))
