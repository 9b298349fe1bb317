"""Tokenizers by context length, and word (character span) -> token positions.

Decisions the papers leave open:
- A tokenizer is identified by (tokenizer source, context length) and cached per process, so a
  `ClipModel` carries only that key: teachers deep-copy cheaply and loader workers pickle nothing big.
- `token_span` widens a character span to whole words before tokenising, because CLIP's BPE works on
  whole words (`dogs` is one token, not `dog` + `s`): a span that cuts a word names the whole word.
  Positions count the start-of-text token (position 0), so they index the tokenized sequence directly;
  positions truncated away by the context length are dropped (the last slot is always EOT).
"""
from __future__ import annotations

import functools
import re

import open_clip
from open_clip.tokenizer import SimpleTokenizer

_WORD_CHAR = re.compile(r"\w")


@functools.lru_cache(maxsize=16)
def get_tokenizer(source: str, context_length: int):
    """open_clip's tokenizer for `source` (a config name or `local-dir:` path) at `context_length`."""
    return open_clip.get_tokenizer(source, context_length=context_length)


def widen_to_words(text: str, char_start: int, char_end: int) -> tuple[int, int]:
    """Grow [char_start, char_end) outwards until both ends sit on word boundaries."""
    if not 0 <= char_start < char_end <= len(text):
        raise ValueError(f"bad character span [{char_start}, {char_end}) for a text of {len(text)} chars")
    while char_start > 0 and _WORD_CHAR.match(text[char_start - 1]) and _WORD_CHAR.match(text[char_start]):
        char_start -= 1
    while char_end < len(text) and _WORD_CHAR.match(text[char_end]) and _WORD_CHAR.match(text[char_end - 1]):
        char_end += 1
    return char_start, char_end


def token_span(tokenizer, text: str, char_start: int, char_end: int) -> list[int]:
    """Positions in `tokenizer([text])[0]` of the BPE tokens that spell text[char_start:char_end].

    The BPE splits on word boundaries, so the tokens of a word-aligned prefix are a prefix of the
    text's tokens; the span is what the prefix up to its end adds to the prefix up to its start.
    """
    if not isinstance(tokenizer, SimpleTokenizer):
        raise NotImplementedError(f"token_span needs CLIP's BPE SimpleTokenizer, got {type(tokenizer).__name__}")
    char_start, char_end = widen_to_words(text, char_start, char_end)
    n_before = len(tokenizer.encode(text[:char_start]))
    n_through = len(tokenizer.encode(text[:char_end]))
    last_word_slot = tokenizer.context_length - 2      # slot context_length - 1 holds EOT after truncation
    return [1 + i for i in range(n_before, n_through) if 1 + i <= last_word_slot]
