"""HarmoCLIP word-region pairs (supplementary §7): COCO category names matched to caption tokens.

For each caption, each COCO category annotated in its image is looked for among the caption's tokens;
a found word gives one row (caption, word, char span, box). Decisions the paper leaves open:

- **Matching is by lemma.** A category's last word matches its singular and plural forms ("circles" ->
  circle, "mice" -> mouse); the words before it match exactly ("traffic light(s)", "teddy bear(s)").
  Multi-word categories are matched as spans, longest first, and the tokens they cover are consumed
  ("teddy bear" never also yields "bear"). Case is ignored. No synonyms unless `aliases` are given
  (the paper says "category label", so "man" does not match `person` by default).
- `lemmatizer="lookup"` (default, ~COCO scale in seconds): spaCy's tokenizer only, plus a table of
  each category word's plural forms. Candidates (regular suffix rules, spaCy's irregular-noun table,
  pyinflect) are kept only if spaCy's own rule lemmatizer maps them back to the category word, so
  "skies" never matches `ski`. `lemmatizer="spacy"`: the full tagger + lemmatizer (~100x slower).
- **One row per (caption, category)**: a category mentioned twice in a caption keeps its first mention
  (the paper: "each caption contains only a single word aligned with one region" per sample); the
  repeats are counted in meta.
- **Several instances of a category** (`instance_rule`): `largest` (default; the box of largest area,
  ties -> lowest annotation id: the most salient instance is the one a caption most likely names),
  `first` (lowest annotation id), `all` (one row per instance, same word).
- Crowd annotations (`iscrowd=1`) are not candidates; boxes are clipped to the image and degenerate
  ones dropped. All of these are counted, never silent.
"""
from __future__ import annotations

import functools
import os
from collections import Counter, defaultdict

import pandas as pd

from clipfinetune.boxes import clip_box, xywh_to_xyxy
from clipfinetune.data import coco as cocoio
from clipfinetune.io import InputError

COLUMNS = ["image_id", "caption_id", "caption_index", "caption", "word", "char_start", "char_end",
           "category", "category_id", "x0", "y0", "x1", "y1"]
INSTANCE_RULES = ("largest", "first", "all")
LEMMATIZERS = ("lookup", "spacy")


@functools.lru_cache(maxsize=1)
def _nlp():
    from clipfinetune.resources import load_spacy

    return load_spacy()


def noun_lemmas(form: str) -> list[str]:
    """spaCy's rule lemmatizer applied to `form` as a NOUN (tables of en_core_web_sm)."""
    from spacy.tokens import Doc

    nlp = _nlp()
    doc = Doc(nlp.vocab, words=[form])
    doc[0].pos_ = "NOUN"
    return nlp.get_pipe("lemmatizer").rule_lemmatize(doc[0])


def noun_forms(word: str) -> set[str]:
    """Singular and plural surface forms of a (lower-case) noun that lemmatize back to it."""
    import pyinflect

    cands = {word + "s", word + "es"}
    if word.endswith("y"):
        cands.add(word[:-1] + "ies")
    if word.endswith("f"):
        cands.add(word[:-1] + "ves")
    if word.endswith("fe"):
        cands.add(word[:-2] + "ves")
    exc = _nlp().get_pipe("lemmatizer").lookups.get_table("lemma_exc")["noun"]
    cands.update(form for form, lemmas in exc.items() if word in lemmas)
    cands.update((pyinflect.getAllInflections(word, pos_type="N") or {}).get("NNS", ()))
    return {word} | {c for c in cands if c != word and word in noun_lemmas(c)}


class CategoryMatcher:
    """Finds category mentions in token sequences; patterns are tuples of lower-case base words."""

    def __init__(self, names: dict[int, str], aliases: dict[str, list[str]] | None = None):
        tok = _nlp().tokenizer
        self.patterns: dict[str, list[tuple[tuple[str, ...], int]]] = defaultdict(list)
        self.form_to_base: dict[str, str] = {}
        for cid, name in sorted(names.items()):
            for phrase in [name, *((aliases or {}).get(name, []))]:
                pat = tuple(t.lower_ for t in tok(phrase.strip()) if not t.is_space)
                if not pat:
                    continue
                self.patterns[pat[0]].append((pat, cid))
                for form in noun_forms(pat[-1]):
                    self.form_to_base.setdefault(form, pat[-1])
        for pats in self.patterns.values():
            pats.sort(key=lambda p: (-len(p[0]), p[1]))   # longest span first
        strings = _nlp().vocab.strings
        words = {w for pats in self.patterns.values() for pat, _ in pats for w in pat} | set(self.form_to_base)
        import numpy as np

        # LOWER hashes of every word a pattern uses: the only tokens the lookup path looks at
        self._key_array = np.array(sorted(strings.add(w) for w in words), dtype=np.uint64)

    def match(self, tokens: list[tuple[str, str, int, int]], allowed: set[int]):
        """tokens: (lower, lemma, char_start, char_end). Yields (category_id, char_start, char_end)."""
        i, n = 0, len(tokens)
        while i < n:
            low, lem = tokens[i][0], tokens[i][1]
            best = None
            for key in (low, lem) if lem != low else (low,):
                for pat, cid in self.patterns.get(key, ()):
                    if cid not in allowed or i + len(pat) > n or (best and len(pat) <= len(best[0])):
                        continue
                    if self._span_matches(pat, tokens, i):
                        best = (pat, cid)
            if best:
                j = i + len(best[0]) - 1
                yield best[1], tokens[i][2], tokens[j][3]
                i = j + 1
            else:
                i += 1

    @staticmethod
    def _span_matches(pat, tokens, i) -> bool:
        if len(pat) == 1:
            return True      # the index key already matched (lower or lemma)
        for k, w in enumerate(pat[:-1]):
            if tokens[i + k][0] != w:
                return False
        low, lem = tokens[i + len(pat) - 1][:2]
        return pat[-1] in (low, lem)

    def lookup_tokens_joined(self, texts: list[str]) -> list[list[tuple[str, str, int, int]]]:
        """Tokens of each text that can take part in a match, from ONE tokenizer call on the texts
        joined by newlines (spaCy's tokenizer splits on whitespace first, so tokens never cross texts;
        one Doc per 1,000 captions instead of one each is what makes COCO scale take seconds).
        Non-adjacent kept tokens are separated by a blank token so they never form a multi-word span."""
        import numpy as np
        from spacy.attrs import IDX, LENGTH, LOWER

        starts, pos = [], 0
        for t in texts:
            starts.append(pos)
            pos += len(t) + 1
        doc = _nlp().tokenizer("\n".join(t.replace("\n", " ") for t in texts))
        arr = doc.to_array([LOWER, IDX, LENGTH])
        hit = np.flatnonzero(np.isin(arr[:, 0], self._key_array))
        owner = np.searchsorted(np.asarray(starts), arr[hit, 1], side="right") - 1
        out: list[list] = [[] for _ in texts]
        strings, f2b, prev = doc.vocab.strings, self.form_to_base, {}
        for i, c in zip(hit.tolist(), owner.tolist()):
            low = strings[int(arr[i, 0])]
            s = int(arr[i, 1]) - starts[c]
            if c in prev and prev[c] != i - 1:
                out[c].append(("", "", -1, -1))
            out[c].append((low, f2b.get(low, low), s, s + int(arr[i, 2])))
            prev[c] = i
        return out

    @staticmethod
    def spacy_tokens(doc) -> list[tuple[str, str, int, int]]:
        # the tagger's lemma counts for nouns only ("boxing" the verb never matches `box`)
        return [(t.lower_, t.lemma_.lower() if t.pos_ in ("NOUN", "PROPN") else t.lower_, t.idx, t.idx + len(t))
                for t in doc]


def _chosen_boxes(anns: list[dict], img: dict, rule: str, counts: Counter) -> dict[int, list[list[float]]]:
    """category id -> the box(es) the instance rule picks, xyxy clipped to the image."""
    by_cat: dict[int, list[tuple[float, int, list[float]]]] = defaultdict(list)
    for a in anns:
        if a.get("iscrowd", 0):
            counts["crowd_instances_ignored"] += 1
            continue
        box = clip_box(xywh_to_xyxy(a["bbox"]), (img["width"], img["height"]))
        if box is None:
            counts["degenerate_boxes_skipped"] += 1
            continue
        by_cat[a["category_id"]].append(((box[2] - box[0]) * (box[3] - box[1]), a["id"], box))
    out = {}
    for cid, cands in by_cat.items():
        if rule == "largest":
            out[cid] = [min(cands, key=lambda c: (-c[0], c[1]))[2]]
        elif rule == "first":
            out[cid] = [min(cands, key=lambda c: c[1])[2]]
        else:
            out[cid] = [c[2] for c in sorted(cands, key=lambda c: c[1])]
    return out


PARALLEL_MIN_CAPTIONS = 20000   # below this, one process (forking costs more than it saves)
_CTX = None   # (matcher, boxes, names, lemmatizer, batch_size) while build_word_regions runs (fork workers)


def _match_chunk(flat):
    matcher, boxes, names, lemmatizer, batch_size = _CTX
    texts = [f[3] for f in flat]
    if lemmatizer == "lookup":
        tokens = [t for i in range(0, len(texts), 1000) for t in matcher.lookup_tokens_joined(texts[i:i + 1000])]
    else:
        tokens = (matcher.spacy_tokens(d) for d in _nlp().pipe(texts, batch_size=batch_size))
    rows, counts, matched_images = [], Counter(), set()
    for (image_id, k, caption_id, text), toks in zip(flat, tokens):
        chosen = boxes.get(image_id)
        if chosen is None:
            counts["captions_dropped_image_not_in_instances"] += 1
            continue
        seen, n_rows = set(), 0
        for cid, s, e in matcher.match(toks, set(chosen)):
            if cid in seen:
                counts["repeated_mentions_dropped"] += 1
                continue
            seen.add(cid)
            for box in chosen[cid]:
                rows.append((image_id, caption_id, k, text, text[s:e], s, e, names[cid], cid, *box))
                n_rows += 1
        if n_rows:
            counts["captions_matched"] += 1
            matched_images.add(image_id)
        else:
            counts["captions_dropped_no_match"] += 1
    return rows, counts, matched_images


def build_word_regions(instances: dict, captions: dict, *, lemmatizer: str = "lookup",
                       instance_rule: str = "largest", aliases: dict[str, list[str]] | None = None,
                       instances_path="<instances>", captions_path="<captions>", batch_size: int = 2000,
                       processes: int | None = None):
    """COCO instances + captions dicts -> (DataFrame with COLUMNS, meta dict of counts).

    From PARALLEL_MIN_CAPTIONS captions on, the matching runs in `processes` forked workers (default: all cores, at most 8)
    over ordered chunks, so the output does not depend on the process count.
    """
    if lemmatizer not in LEMMATIZERS:
        raise ValueError(f"lemmatizer must be one of {LEMMATIZERS}, got {lemmatizer!r}")
    if instance_rule not in INSTANCE_RULES:
        raise ValueError(f"instance_rule must be one of {INSTANCE_RULES}, got {instance_rule!r}")
    names = cocoio.categories(instances, instances_path)
    images = cocoio.images_by_id(instances, instances_path)
    anns = cocoio.instances_by_image(instances, instances_path)
    for image_id, lst in anns.items():
        if image_id not in images:
            raise InputError(instances_path, lst[0]["id"], f"annotation of unknown image {image_id}")
        for a in lst:
            if a["category_id"] not in names:
                raise InputError(instances_path, a["id"], f"unknown category_id {a['category_id']}")
    counts: Counter = Counter()
    caps = cocoio.captions_by_image(captions, captions_path, counts)
    boxes = {i: _chosen_boxes(anns.get(i, []), images[i], instance_rule, counts) for i in images}
    matcher = CategoryMatcher(names, aliases)

    flat = [(image_id, k, cid, text) for image_id, lst in caps.items() for k, (cid, text) in enumerate(lst)]
    counts["captions"] = len(flat)
    counts["images_with_captions"] = len(caps)
    global _CTX
    _CTX = (matcher, boxes, names, lemmatizer, batch_size)
    try:
        n_proc = max(1, min(processes or os.cpu_count() or 1, 8)) if len(flat) >= PARALLEL_MIN_CAPTIONS else 1
        step = max(1, -(-len(flat) // (n_proc * 8)))
        chunks = [flat[i:i + step] for i in range(0, len(flat), step)]
        if n_proc > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(n_proc) as pool:
                results = pool.map(_match_chunk, chunks, chunksize=1)   # ordered: deterministic output
        else:
            results = [_match_chunk(c) for c in chunks]
    finally:
        _CTX = None
    rows, matched_images = [], set()
    for r, c, m in results:
        rows.extend(r)
        counts.update(c)
        matched_images.update(m)
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame = frame.astype({"image_id": "int64", "caption_id": "int64", "caption_index": "int32",
                          "char_start": "int32", "char_end": "int32", "category_id": "int32",
                          "x0": "float32", "y0": "float32", "x1": "float32", "y1": "float32"})
    meta = {"rows": len(frame), "images_matched": len(matched_images), "lemmatizer": lemmatizer,
            "instance_rule": instance_rule, "categories": len(names), **dict(sorted(counts.items()))}
    for key in ("captions_dropped_no_match", "captions_matched", "repeated_mentions_dropped",
                "crowd_instances_ignored", "degenerate_boxes_skipped", "captions_dropped_image_not_in_instances",
                "empty_captions_skipped"):
        meta.setdefault(key, 0)
    return frame, meta
