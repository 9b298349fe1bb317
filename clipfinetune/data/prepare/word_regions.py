"""HarmoCLIP word-region pairs (supplementary §7): COCO category names matched to caption tokens.

For each caption, each COCO category annotated in its image is looked for among the caption's tokens;
a found word gives one row (caption, word, char span, box). Decisions the paper leaves open:

- **Matching is by lemma.** A category's last word matches its singular and plural forms ("circles" ->
  circle, "mice" -> mouse); the words before it match exactly ("traffic light(s)", "teddy bear(s)").
  Multi-word categories are matched as spans, longest first, and the tokens they cover are consumed
  ("teddy bear" never also yields "bear"). Case is ignored. No synonyms unless `aliases` are given
  (the paper says "category label", so "man" does not match `person` by default); `synonyms="chair"` adds COCO's
  usual synonym table (the CHAIR metric's, `chair_synonyms.txt`: "man" -> person, "bike" -> bicycle), which
  brings real COCO captions from ~0.82 word-region pairs per caption towards HarmoCLIP's ~1.01 (599K / 591K).
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
from pathlib import Path

import numpy as np
import pandas as pd

from clipfinetune.data.prepare.instance_boxes import boxes_np, boxes_scalar, instances_checked
from clipfinetune.data.readers import coco as cocoio

COLUMNS = ["image_id", "caption_id", "caption_index", "caption", "word", "char_start", "char_end",
           "category", "category_id", "x0", "y0", "x1", "y1"]
INSTANCE_RULES = ("largest", "first", "all")
SYNONYM_TABLES = {"none": None, "chair": "chair_synonyms.txt"}      # word_regions.synonyms -> file beside this one
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


def synonym_aliases(table: str) -> dict[str, list[str]]:
    """{category name: [synonym, ...]} of a synonym table by name (SYNONYM_TABLES); "none" -> {}."""
    if table not in SYNONYM_TABLES:
        raise ValueError(f"synonyms must be one of {sorted(SYNONYM_TABLES)}, got {table!r}")
    if SYNONYM_TABLES[table] is None:
        return {}
    out: dict[str, list[str]] = {}
    for line in (Path(__file__).parent / SYNONYM_TABLES[table]).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, *words = [w.strip() for w in line.split(",")]
            out[name] = [w for w in dict.fromkeys(words) if w and w != name]
    return out


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
        self._key_set = {strings.add(w) for w in words}   # LOWER hashes: the only tokens the lookup path looks at
        self._chunks: dict[str, tuple | bool] = {}   # space-free chunk -> (n tokens, kept tokens) | False
        # a special case holding a space could re-join tokens across chunks (English has none)
        self._chunkable = not any(" " in r.strip() for r in tok.rules)

    def match(self, tokens: list[tuple[str, str, int, int]], allowed):
        """tokens: (lower, lemma, char_start, char_end); allowed: container of category ids.
        Yields (category_id, char_start, char_end)."""
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

    def text_tokens(self, text: str) -> list[tuple[str, str, int, int]]:
        """Tokens of `text` (spaCy's tokenizer on the whole text) that can take part in a match; non-adjacent
        ones are separated by a blank token so they never form a multi-word span. The reference for
        `caption_tokens`, and its fallback."""
        from spacy.attrs import IDX, LENGTH, LOWER

        doc, out, prev = _nlp().tokenizer(text.replace("\n", " ")), [], None
        for i, (h, s, n) in enumerate(doc.to_array([LOWER, IDX, LENGTH]).tolist()):
            if h in self._key_set:
                if prev is not None and prev != i - 1:
                    out.append(("", "", -1, -1))
                low = doc.vocab.strings[h]
                out.append((low, self.form_to_base.get(low, low), s, s + n))
                prev = i
        return out

    def caption_tokens(self, text: str) -> list[tuple[str, str, int, int]]:
        """`text_tokens(text)` from a per-chunk cache. spaCy's tokenizer splits on whitespace
        first and tokenizes each chunk on its own (its own cache is keyed by the chunk), so a caption's tokens
        are its space-separated chunks' tokens; the ~10^4 distinct chunks of COCO are tokenized once each
        instead of ~6M tokens going through spaCy and Python again per caption. Identical to `text_tokens`
        on whitespace-normalised text (as `captions_by_image` gives); anything else takes `text_tokens`."""
        if not self._chunkable:
            return self.text_tokens(text)
        out, cache, prev, n, at = [], self._chunks, -2, 0, 0
        for chunk in text.split(" "):
            info = cache.get(chunk)
            if info is None:
                info = cache[chunk] = self._chunk_tokens(chunk)
            if info is False:       # not whitespace-normalised: the reference path
                return self.text_tokens(text)
            ntok, kept = info
            for ti, low, base, s, e in kept:
                if out and prev != n + ti - 1:
                    out.append(("", "", -1, -1))
                out.append((low, base, at + s, at + e))
                prev = n + ti
            n += ntok
            at += len(chunk) + 1
        return out

    def _chunk_tokens(self, chunk: str):
        """(n tokens, kept tokens as (index, lower, base, start, end)) of a space-free chunk; False if not one."""
        from spacy.attrs import IDX, LENGTH, LOWER

        if chunk.split() != [chunk]:
            return False
        doc, strings, f2b = _nlp().tokenizer(chunk), _nlp().vocab.strings, self.form_to_base
        kept = [(ti, strings[h], f2b.get(strings[h], strings[h]), idx, idx + length)
                for ti, (h, idx, length) in enumerate(doc.to_array([LOWER, IDX, LENGTH]).tolist())
                if h in self._key_set]
        return len(doc), tuple(kept)

    @staticmethod
    def spacy_tokens(doc) -> list[tuple[str, str, int, int]]:
        # the tagger's lemma counts for nouns only ("boxing" the verb never matches `box`)
        return [(t.lower_, t.lemma_.lower() if t.pos_ in ("NOUN", "PROPN") else t.lower_, t.idx, t.idx + len(t))
                for t in doc]


PARALLEL_MIN_CAPTIONS = 20000   # below this, one process (forking costs more than it saves)
_CTX = None   # (matcher, boxes by image, category index, caption image ids, texts, lemmatizer, batch_size) for workers


def _match_range(lo_hi):
    """Captions lo..hi-1 -> int64 [n, 5] rows (caption position, category index, char start, char end, box row),
    Counter. Workers read everything from the forked _CTX: only two ints go in, small arrays come back."""
    matcher, img_boxes, cat_index, cap_img, texts, lemmatizer, batch_size = _CTX
    lo, hi = lo_hi
    docs = iter(_nlp().pipe(texts[lo:hi], batch_size=batch_size)) if lemmatizer == "spacy" else None
    rows, counts = [], Counter()
    for p in range(lo, hi):
        toks = matcher.spacy_tokens(next(docs)) if docs is not None else None
        chosen = img_boxes.get(cap_img[p])
        if chosen is None:
            counts["captions_dropped_image_not_in_instances"] += 1
            continue
        if toks is None:
            toks = matcher.caption_tokens(texts[p]) if chosen else ()   # no candidate box: nothing can match
        seen, n_rows = set(), 0
        for cid, s, e in matcher.match(toks, chosen):
            if cid in seen:
                counts["repeated_mentions_dropped"] += 1
                continue
            seen.add(cid)
            for b in chosen[cid]:
                rows.append((p, cat_index[cid], s, e, b))
                n_rows += 1
        counts["captions_matched" if n_rows else "captions_dropped_no_match"] += 1
    return np.array(rows, dtype=np.int64).reshape(-1, 5), counts


@cocoio.gc_paused()
def build_word_regions(instances: dict, captions: dict, *, lemmatizer: str = "lookup",
                       instance_rule: str = "largest", aliases: dict[str, list[str]] | None = None,
                       synonyms: str = "none", instances_path="<instances>", captions_path="<captions>",
                       batch_size: int = 2000,
                       processes: int | None = None):
    """COCO instances + captions dicts -> (DataFrame with COLUMNS, meta dict of counts).

    From PARALLEL_MIN_CAPTIONS captions on, the matching runs in `processes` forked workers (default: all cores, at most
    8) over ordered chunks, so the output does not depend on the process count.
    """
    if lemmatizer not in LEMMATIZERS:
        raise ValueError(f"lemmatizer must be one of {LEMMATIZERS}, got {lemmatizer!r}")
    if instance_rule not in INSTANCE_RULES:
        raise ValueError(f"instance_rule must be one of {INSTANCE_RULES}, got {instance_rule!r}")
    names = cocoio.categories(instances, instances_path)
    images = cocoio.images_by_id(instances, instances_path)
    counts: Counter = Counter()
    chosen = boxes_np(instances, images, names, instance_rule, counts)
    anns = instances_checked(instances, images, names, instances_path) if chosen is None else None
    caps = cocoio.captions_by_image(captions, captions_path, counts)   # after the instance checks, as always
    boxes, img_boxes = chosen or boxes_scalar(anns, images, instance_rule, counts)
    table = synonym_aliases(synonyms)
    matcher = CategoryMatcher(names,
                              {n: table.get(n, []) + (aliases or {}).get(n, []) for n in {*table, *(aliases or {})}})

    cap_img = [i for i, lst in caps.items() for _ in lst]
    cap_k = [k for lst in caps.values() for k in range(len(lst))]
    cap_id = [c for lst in caps.values() for c, _ in lst]
    texts = [t for lst in caps.values() for _, t in lst]
    counts["captions"] = len(texts)
    counts["images_with_captions"] = len(caps)
    cat_ids = list(names)
    global _CTX
    _CTX = (matcher, img_boxes, {c: j for j, c in enumerate(cat_ids)}, cap_img, texts, lemmatizer, batch_size)
    try:
        n_proc = max(1, min(processes or os.cpu_count() or 1, 8)) if len(texts) >= PARALLEL_MIN_CAPTIONS else 1
        step = max(1, -(-len(texts) // (n_proc * 8)))
        ranges = [(i, min(i + step, len(texts))) for i in range(0, len(texts), step)]
        if n_proc > 1:
            import multiprocessing as mp

            with mp.get_context("fork").Pool(n_proc) as pool:
                results = pool.map(_match_range, ranges, chunksize=1)   # ordered: deterministic output
        else:
            results = [_match_range(r) for r in ranges]
    finally:
        _CTX = None
    for _, c in results:
        counts.update(c)
    pos, ci, s, e, b = np.concatenate([r for r, _ in results] or [np.zeros((0, 5), np.int64)]).T
    plist, slist, elist = pos.tolist(), s.tolist(), e.tolist()
    # columns of the same Python objects row tuples would hold: the same dtype inference (no rows: as before)
    frame = pd.DataFrame([], columns=COLUMNS) if not plist else pd.DataFrame({
        "image_id": [cap_img[p] for p in plist], "caption_id": [cap_id[p] for p in plist],
        "caption_index": [cap_k[p] for p in plist], "caption": [texts[p] for p in plist],
        "word": [texts[p][i:j] for p, i, j in zip(plist, slist, elist)], "char_start": s, "char_end": e,
        "category": [names[cat_ids[c]] for c in ci.tolist()], "category_id": [cat_ids[c] for c in ci.tolist()],
        **{k: boxes[b, j] for j, k in enumerate(("x0", "y0", "x1", "y1"))}}, columns=COLUMNS)
    frame = frame.astype({"image_id": "int64", "caption_id": "int64", "caption_index": "int32",
                          "char_start": "int32", "char_end": "int32", "category_id": "int32",
                          "x0": "float32", "y0": "float32", "x1": "float32", "y1": "float32"})
    meta = {"rows": len(frame), "images_matched": len({cap_img[p] for p in set(plist)}), "lemmatizer": lemmatizer,
            "instance_rule": instance_rule, "synonyms": synonyms, "categories": len(names),
            **dict(sorted(counts.items()))}
    for key in ("captions_dropped_no_match", "captions_matched", "repeated_mentions_dropped",
                "crowd_instances_ignored", "degenerate_boxes_skipped", "captions_dropped_image_not_in_instances",
                "empty_captions_skipped"):
        meta.setdefault(key, 0)
    return frame, meta
