"""DeGLA hard negatives for a caption corpus: ask a backend, cache, validate, merge to K = 4.

Flow (`generate_negatives`): every distinct caption x the five rewrite types (variant 0) -> answers
from the cache or the backend (`rules`, `server`, `offline`) -> every answer validated
(`negative_validators.check`, rejects counted by reason) -> merged into K slots.

Merge rule (DeGLA trains on K = 4 "due to the merging of two subtypes"; the appendix never says which):
the two *swap* subtypes share one slot, as ARO/SugarCrepe group swaps, giving the slots
`reshuffle | swap | replace_adjectives | replace_nouns`. The swap slot takes swap_nouns or
swap_adjectives, whichever is valid; when both are, a hash of the caption picks one, so the two
subtypes are balanced over the corpus. A slot left empty (invalid answer, or nothing to swap in a
one-object caption) or duplicating another slot is filled from, in order: the unused swap answer, then a
second answer (variant 1) of replace_nouns and of replace_adjectives, asked only for such captions.
Each row's `type` names the subtype that produced it. `valid4` = K distinct negatives, each different
from the caption and valid for its own type.

No silent gaps: a request still unanswered after the backend's retries is a hole in the table, so more than
`max_failures` of them raise `MissingAnswersError` (with the count) before anything is merged; the answers
received are in the cache, so the next run asks only the missing ones.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter

from clipfinetune.data.negatives.degla.cache import answer_key
from clipfinetune.data.negatives.degla.llm import Request
from clipfinetune.data.negatives.degla.validators import TYPES, check
from clipfinetune.data.negatives.rules import warm

log = logging.getLogger(__name__)
FILL_TYPES = ("replace_nouns", "replace_adjectives")
COLUMNS = ("image_id", "caption_index", "caption", "type", "negative")


class MissingAnswersError(RuntimeError):
    """More requests than allowed got no answer after their retries (the answers received are cached)."""

    def __init__(self, failed: int, asked: int, allowed: int, last_error: str):
        self.failed, self.asked, self.allowed, self.last_error = failed, asked, allowed, last_error
        super().__init__(f"{failed} of {asked} LLM requests got no answer after their retries (at most {allowed} "
                         f"allowed; last error: {last_error or 'none'}). The answers received are cached: a "
                         f"re-run asks only the {failed} missing ones")


def caption_records(records) -> list[dict]:
    """Reader `Record`s -> [{image_id, caption_index, caption}], one per short caption, caption_index = its position
    in `record.captions` (the reader's rule, e.g. COCO's file order), records in the reader's order."""
    return [{"image_id": str(r.image_id), "caption_index": k, "caption": caption}
            for r in records for k, caption in enumerate(r.captions)]


def _pick_swap_first(caption: str, seed: int) -> bool:
    return hashlib.sha256(f"{seed}|{caption}".encode()).digest()[0] % 2 == 0


class _Answers:
    """Answers for this run: the cache's view plus validation, keyed like the cache."""

    def __init__(self, backend, cache, prompt_version: str, max_failures: int | None):
        self.backend, self.cache, self.pv, self.max_failures = backend, cache, prompt_version, max_failures
        self.model = getattr(backend, "cache_id", None) or backend.model   # model + sampling settings
        self.asked = 0
        self.cached = 0
        self.failed = 0

    def key(self, caption, type_, variant=0):
        return answer_key(caption, type_, variant, self.pv, self.backend.name, self.model)

    def ensure(self, wanted: list[tuple[str, str, int]]) -> None:
        reqs, seen = [], set()
        for cap, t, v in wanted:
            k = self.key(cap, t, v)
            if k in seen:
                continue
            seen.add(k)
            if k in self.cache:
                self.cached += 1
            else:
                reqs.append(Request(k, cap, t, v))
        if not reqs:
            return
        log.info("negatives: asking %s for %d answers (%d cached)", self.backend.name, len(reqs), self.cached)

        def on_result(req, text, error, raw):
            self.cache.append({"key": req.key, "caption": req.caption, "type": req.type, "variant": req.variant,
                               "prompt_version": self.pv, "backend": self.backend.name,
                               "model": self.model, "text": text, "error": error, "raw": raw})

        self.asked += len(reqs)
        stats = self.backend.run(reqs, on_result) or {}
        self.failed += stats.get("failed", 0)
        if self.max_failures is not None and self.failed > self.max_failures:
            raise MissingAnswersError(self.failed, self.asked, self.max_failures, stats.get("last_error", ""))

    def verdict(self, caption, type_, variant=0) -> tuple[str | None, str]:
        """(negative, "") if valid, else (None, reason)."""
        rec = self.cache.get(self.key(caption, type_, variant))
        if rec is None:
            return None, "request_failed"
        if rec.get("error"):
            return None, rec["error"]
        reason = check(caption, rec.get("text"), type_)
        return (rec["text"], "") if reason is None else (None, reason)


def _merge(caption: str, verdicts: dict, k: int, seed: int, dup: Counter) -> list[tuple[str, str]]:
    """[(type, negative)] for the K slots (see the module docstring); fewer when the pool runs dry."""
    chosen: list[tuple[str, str]] = []
    used = {caption.lower().strip()}
    swaps = [t for t in ("swap_nouns", "swap_adjectives") if verdicts.get((t, 0), (None,))[0]]
    if len(swaps) == 2 and not _pick_swap_first(caption, seed):
        swaps.reverse()
    order = [("reshuffle", 0)] + [(t, 0) for t in swaps[:1]] + [("replace_adjectives", 0), ("replace_nouns", 0)]
    fill = [(t, 0) for t in swaps[1:]] + [(t, 1) for t in FILL_TYPES]
    for tv in order + fill:
        if len(chosen) >= k:
            break
        neg = verdicts.get(tv, (None,))[0]
        if neg is None:
            continue
        if neg.lower().strip() in used:
            dup["duplicate"] += 1
            continue
        used.add(neg.lower().strip())
        chosen.append((tv[0], neg))
    return chosen


def generate_negatives(records: list[dict], backend, cache, prompt_version: str, per_caption: int = 4,
                       seed: int = 0, max_failures: int | None = None) -> tuple[list[dict], dict]:
    """Rows (COLUMNS) in record order x slot order, and the statistics for meta/metrics. `max_failures`: how many
    requests may stay unanswered (None: any number, each counted as `request_failed`)."""
    captions = list(dict.fromkeys(r["caption"] for r in records))
    warm(captions)
    backend.prepare(captions)
    ans = _Answers(backend, cache, prompt_version, max_failures)
    ans.ensure([(c, t, 0) for c in captions for t in TYPES])

    rejects, per_type_valid, dup = Counter(), Counter(), Counter()
    verdicts: dict[str, dict] = {}
    n_answers = 0

    def judge(c, t, v):
        nonlocal n_answers
        neg, reason = ans.verdict(c, t, v)
        verdicts[c][(t, v)] = (neg, reason)
        if reason != "request_failed":
            n_answers += 1
        if neg is None:
            rejects[reason] += 1
        else:
            per_type_valid[t] += 1

    for c in captions:
        verdicts[c] = {}
        for t in TYPES:
            judge(c, t, 0)
    short = [c for c in captions if len(_merge(c, verdicts[c], per_caption, seed, Counter())) < per_caption]
    if short:
        ans.ensure([(c, t, 1) for c in short for t in FILL_TYPES])
        for c in short:
            for t in FILL_TYPES:
                judge(c, t, 1)
    merged = {c: _merge(c, verdicts[c], per_caption, seed, dup) for c in captions}

    rows = [{"image_id": r["image_id"], "caption_index": int(r["caption_index"]), "caption": r["caption"],
             "type": t, "negative": neg} for r in records for t, neg in merged[r["caption"]]]
    full = sum(len(merged[r["caption"]]) == per_caption for r in records)
    n_rejected = sum(rejects.values())
    stats = {
        "backend": backend.name, "model": backend.model, "cache_id": ans.model, "prompt_version": prompt_version,
        "per_caption": per_caption, "merge": "swap_nouns+swap_adjectives share one slot; fill: other swap, "
                                             "replace_nouns#2, replace_adjectives#2",
        "captions": len(records), "distinct_captions": len(captions), "rows": len(rows),
        "answers": n_answers, "requests_asked": ans.asked, "answers_from_cache": ans.cached,
        "requests_failed": ans.failed, "fill_requests_for": len(short),
        "rejects": dict(sorted(rejects.items())), "duplicates_dropped": dup["duplicate"],
        "valid_per_type": {t: per_type_valid[t] for t in TYPES},
        "type_counts": dict(sorted(Counter(row["type"] for row in rows).items())),
        "valid4_rate": round(100.0 * full / max(len(records), 1), 3),
        "reject_rate": round(100.0 * n_rejected / max(n_answers + rejects["request_failed"], 1), 3),
        "cache_corrupt_lines": getattr(cache, "corrupt_lines", 0),
    }
    return rows, stats
