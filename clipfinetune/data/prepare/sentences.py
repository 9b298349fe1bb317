"""Long captions -> sentence subcaptions (MulCLIP §3.1 and appendix VI; GOAL's LISM), plus the readers of
the long-caption corpora (DOCCI, DCI, Urban1k, ShareGPT4V training files; BENCHMARKS §3).

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
- All splits of a corpus are processed (LISM also builds GOAL's joint test list from the test split);
  consumers select the split by the corpus's own ids (DOCCI: `example_id` starts with `train`/`test`).
"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from clipfinetune.io import InputError, read_jsonlines

COLUMNS = ["image_id", "source", "long_caption", "sentence_index", "text", "char_start", "char_end"]
SEGMENTERS = ("senter", "parser")


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


def split_sentences(records: Iterable[dict], *, max_sentences: int = 15, segmenter: str = "senter",
                    batch_size: int = 64):
    """records: dicts with image_id, source, long_caption -> (DataFrame with COLUMNS, meta counts)."""
    if max_sentences < 1:
        raise ValueError("max_sentences must be >= 1")
    counts: Counter = Counter()
    kept = []
    seen = set()
    for r in records:
        key = (r["source"], str(r["image_id"]))
        if key in seen:
            raise InputError(r.get("path", r["source"]), r["image_id"], "duplicate image id")
        seen.add(key)
        text = (r.get("long_caption") or "").strip()
        if not text:
            counts["empty_long_captions_skipped"] += 1
            continue
        kept.append((key[1], r["source"], text))
    lines = [(n, s, e) for n, (_, _, text) in enumerate(kept) for s, e in line_spans(text)]
    per_caption: list[list[tuple[int, int]]] = [[] for _ in kept]
    for (n, s0, e0), doc in zip(lines, segment_docs((kept[n][2][s:e] for n, s, e in lines), segmenter, batch_size)):
        per_caption[n] += [(s0 + s, s0 + e) for s, e in sentence_spans(doc)]
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
    meta = {"rows": len(frame), "segmenter": f"spacy en_core_web_sm {segmenter}", "max_sentences": max_sentences}
    for key in ("long_captions", "empty_long_captions_skipped", "captions_over_cap", "sentences_dropped_over_cap",
                "punctuation_only_sentences_skipped", "single_sentence_captions"):
        meta[key] = counts.pop(key, 0)
    meta.update(sorted(counts.items()))
    return frame, meta


# ---------------------------------------------------------------- readers (BENCHMARKS §3)
def read_docci(path: str | os.PathLike, splits: tuple[str, ...] | None = None) -> list[dict]:
    """DOCCI `docci_descriptions.jsonlines`: example_id, split, image_file, description."""
    path, out = Path(path), []
    for n, ex in read_jsonlines(path):
        missing = [k for k in ("example_id", "split", "image_file", "description") if k not in ex]
        if missing:
            raise InputError(path, ex.get("example_id", f"line {n}"), f"missing keys {missing}")
        if splits is None or ex["split"] in splits:
            out.append({"image_id": str(ex["example_id"]), "source": "docci", "split": ex["split"],
                        "image": ex["image_file"], "long_caption": ex["description"], "path": str(path)})
    return out


def read_dci(root: str | os.PathLike, split: str | None = None) -> list[dict]:
    """DCI `densely_captioned_images/`: complete/<key>.json (`image`, `extra_caption`), splits.json.

    GOAL's long text is DCI's `extra_caption` (BENCHMARKS §3.2); image_id = the entry key's stem."""
    root = Path(root)
    if split is not None:
        splits = json.loads((root / "splits.json").read_text())
        if split not in splits:
            raise InputError(root / "splits.json", split, "no such split")
        keys = list(splits[split])
    else:
        keys = sorted(p.name for p in (root / "complete").glob("*.json"))
    out = []
    for key in keys:
        p = root / "complete" / key
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(p, key, f"unreadable DCI entry: {e}") from e
        if "image" not in data or "extra_caption" not in data:
            raise InputError(p, key, "DCI entry lacks `image` or `extra_caption`")
        out.append({"image_id": Path(key).stem, "source": "dci", "split": split or "",
                    "image": str(Path("photos") / data["image"]), "long_caption": data["extra_caption"],
                    "path": str(p)})
    return out


def read_urban1k(root: str | os.PathLike) -> list[dict]:
    """Urban1k: caption/<n>.txt (first line = caption) and image/<n>.jpg, ordered by n."""
    root = Path(root)
    files = sorted((root / "caption").glob("*.txt"), key=lambda p: (len(p.stem), p.stem))
    if not files:
        raise InputError(root / "caption", None, "no caption files")
    return [{"image_id": p.stem, "source": "urban1k", "split": "test", "image": f"image/{p.stem}.jpg",
             "long_caption": (p.read_text(encoding="utf-8").splitlines() or [""])[0], "path": str(p)}
            for p in files]


def read_sharegpt4v(path: str | os.PathLike, skip_first: int = 0) -> list[dict]:
    """ShareGPT4V json list: id, image, conversations[{"from": "gpt", "value": <long caption>}].

    Long-CLIP holds out the first 1,000 records as its test set (`skip_first=1000` for training)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(path, None, f"unreadable ShareGPT4V file: {e}") from e
    out = []
    for n, rec in enumerate(data[skip_first:], skip_first):
        gpt = [c.get("value", "") for c in rec.get("conversations", []) if c.get("from") == "gpt"]
        if "image" not in rec or not gpt:
            raise InputError(path, rec.get("id", n), "record lacks `image` or a gpt turn")
        out.append({"image_id": str(rec.get("id", n)), "source": "sharegpt4v", "split": "train",
                    "image": rec["image"], "long_caption": gpt[0], "path": str(path)})
    return out
