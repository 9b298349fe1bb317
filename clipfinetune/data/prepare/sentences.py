"""Long captions -> sentence subcaptions (MulCLIP §3.1 and appendix VI; GOAL's LISM). The long-caption corpora
(DOCCI, DCI, Urban1k, ShareGPT4V; docs/evalsets.md §3) are read by `clipfinetune.data.readers`.

Decisions:
- Sentences come from spaCy's statistical sentence segmenter (`senter` of en_core_web_sm; the dependency
  parser is the optional, slower `segmenter="parser"`), never `split('.')`: "3.5 m", "Dr.", "e.g." stay
  inside their sentence. Each sentence keeps its character span into the stored long caption (GOAL pools
  the sentence's tokens inside the long caption); spans exclude surrounding whitespace, so
  `long_caption[char_start:char_end] == text` always.
- The stored long caption is the corpus text with leading/trailing whitespace stripped (nothing else
  changed: newlines stay, spans point into it).
- Sentence 0 is the summary (MulCLIP: "the first sentence serves as the summary"). At most
  `max_sentences` are kept (MulCLIP's 15); the rest are dropped and counted, the long caption is kept whole.
- A line break always ends a sentence (the statistical segmenter misses "...1.\nBroccoli."); each line
  is segmented on its own.
- A long caption without a boundary is one sentence; an empty one is skipped and counted; a "sentence"
  without a letter or digit (stray punctuation) is skipped and counted.
- `splitter` picks the rule: "spacy" (the above), "period" (GOAL's LISM: `caption.split('.')`, pieces stripped,
  empties removed: "3.5 m" and "Dr." break, line breaks do not; docs/methods.md §3.1) or "punctuation" (MulCLIP App. VI
  "punctuation-based splitting": a sentence ends after a run of '.', '!' or '?', kept in it, or at a line break).
  The punctuation-only skip and the cap apply to every splitter.
- Every record given is processed, whatever its split (LISM also builds GOAL's joint test list from the test
  split); consumers select the split through the reader's `split` field.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

import pandas as pd

from clipfinetune.io import InputError

COLUMNS = ["image_id", "source", "long_caption", "sentence_index", "text", "char_start", "char_end"]
SEGMENTERS = ("senter", "parser")
SPLITTERS = ("spacy", "period", "punctuation")
RULES = {"period": re.compile(r"[^.]+"), "punctuation": re.compile(r"[^.!?\n]+[.!?]*")}
RULE_NAMES = {"period": "split on '.' (GOAL's LISM)", "punctuation": "split after . ! ? and at line breaks (MulCLIP)"}


def segment_docs(texts: Iterable[str], segmenter: str = "senter", batch_size: int = 64):
    """Docs with sentence boundaries, from the shared en_core_web_sm (`load_spacy()`): its tokenizer, then
    only the components segmentation needs, called directly (the shared pipeline is never modified and
    the model is loaded once per process)."""
    from clipfinetune.resources import load_spacy

    if segmenter not in SEGMENTERS:
        raise ValueError(f"segmenter must be one of {SEGMENTERS}, got {segmenter!r}")
    nlp = load_spacy()
    docs = nlp.tokenizer.pipe(texts, batch_size=batch_size)
    names = ("senter",) if segmenter == "senter" else ("tok2vec", "parser")   # senter has its own tok2vec
    for name in names:
        docs = nlp.get_pipe(name).pipe(docs, batch_size=batch_size)
    return docs


def _trim(text: str, s: int, e: int) -> tuple[int, int]:
    while s < e and text[s].isspace():
        s += 1
    while e > s and text[e - 1].isspace():
        e -= 1
    return s, e


def sentence_spans(doc) -> list[tuple[int, int]]:
    """Whitespace-trimmed (start, end) character spans of a Doc's sentences; empty ones removed."""
    spans = []
    for sent in doc.sents:
        s, e = _trim(doc.text, sent.start_char, sent.end_char)
        if e > s:
            spans.append((s, e))
    return spans


def line_spans(text: str) -> list[tuple[int, int]]:
    """Trimmed spans of the non-blank lines: a line break always ends a sentence (DCI, ShareGPT4V)."""
    spans, start = [], 0
    for line in text.split("\n"):
        s, e = _trim(text, start, start + len(line))
        if e > s:
            spans.append((s, e))
        start += len(line) + 1
    return spans


def rule_spans(text: str, splitter: str) -> list[tuple[int, int]]:
    """Trimmed, non-empty spans of a rule-based splitter ("period" | "punctuation")."""
    spans = [_trim(text, m.start(), m.end()) for m in RULES[splitter].finditer(text)]
    return [(s, e) for s, e in spans if e > s]


def split_sentences(records: Iterable[dict], *, max_sentences: int = 15, segmenter: str = "senter",
                    batch_size: int = 64, splitter: str = "spacy"):
    """records: `readers.Record`s (image_id, source, long_caption) -> (DataFrame with COLUMNS, meta counts)."""
    if max_sentences < 1:
        raise ValueError("max_sentences must be >= 1")
    if splitter not in SPLITTERS:
        raise ValueError(f"sentences.splitter must be one of {SPLITTERS}, got {splitter!r}")
    counts: Counter = Counter()
    kept = []
    seen = set()
    for r in records:
        key = (r.source, str(r.image_id))
        if key in seen:
            raise InputError(r.origin or r.source, r.image_id, "duplicate image id")
        seen.add(key)
        text = (r.long_caption or "").strip()
        if not text:
            counts["empty_long_captions_skipped"] += 1
            continue
        kept.append((key[1], r.source, text))
    per_caption: list[list[tuple[int, int]]] = [[] for _ in kept]
    if splitter == "spacy":
        lines = [(n, s, e) for n, (_, _, text) in enumerate(kept) for s, e in line_spans(text)]
        docs = segment_docs((kept[n][2][s:e] for n, s, e in lines), segmenter, batch_size)
        for (n, s0, e0), doc in zip(lines, docs):
            per_caption[n] += [(s0 + s, s0 + e) for s, e in sentence_spans(doc)]
    else:
        per_caption = [rule_spans(text, splitter) for _, _, text in kept]
    rows = []
    for (image_id, source, text), found in zip(kept, per_caption):
        spans = []
        for s, e in found:
            if any(ch.isalnum() for ch in text[s:e]):
                spans.append((s, e))
            else:
                counts["punctuation_only_sentences_skipped"] += 1
        if not spans:
            counts["empty_long_captions_skipped"] += 1
            continue
        if len(spans) > max_sentences:
            counts["captions_over_cap"] += 1
            counts["sentences_dropped_over_cap"] += len(spans) - max_sentences
            spans = spans[:max_sentences]
        counts["long_captions"] += 1
        counts[f"long_captions_{source}"] += 1
        if len(spans) == 1:
            counts["single_sentence_captions"] += 1
        for i, (s, e) in enumerate(spans):
            rows.append((image_id, source, text, i, text[s:e], s, e))
    frame = pd.DataFrame(rows, columns=COLUMNS).astype(
        {"image_id": "str", "source": "str", "sentence_index": "int32", "char_start": "int32", "char_end": "int32"})
    name = f"spacy en_core_web_sm {segmenter}" if splitter == "spacy" else RULE_NAMES[splitter]
    meta = {"rows": len(frame), "segmenter": name, "max_sentences": max_sentences}
    for key in ("long_captions", "empty_long_captions_skipped", "captions_over_cap", "sentences_dropped_over_cap",
                "punctuation_only_sentences_skipped", "single_sentence_captions"):
        meta[key] = counts.pop(key, 0)
    meta.update(sorted(counts.items()))
    return frame, meta
