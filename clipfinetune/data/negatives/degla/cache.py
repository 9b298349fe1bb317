"""Append-only JSONL cache of hard-negative answers, kept outside DVC's outputs.

DVC deletes a stage's outputs before running it, so the cache lives elsewhere (the stage uses
`data/cache/negatives/`). One JSON object per line, keyed by `answer_key(caption, type, variant,
prompt_version, backend, model)`:

- a line is written with one `os.write` on an `O_APPEND` descriptor, then flushed to disk every
  `fsync_every` lines and on close, so concurrent writers never interleave inside a line;
- a run killed mid-write leaves at most one truncated last line: the reader skips lines that do not
  parse (counted in `corrupt_lines`), and the writer first terminates such a line with a newline, so the
  next record always starts on a line of its own;
- the last record of a key wins, so a re-run never asks again what is already answered;
- in memory only each key's `text` and `error` are kept (not the prompt's fields or the raw reply), so millions
  of answers (DeGLA on COCO: ~2.5M) fit in a few hundred MB.
Only answers are cached (including malformed ones, with the reason); transport failures (timeouts,
5xx, unreachable server) are not, so a re-run asks them again.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path


def answer_key(caption: str, type_: str, variant: int, prompt_version: str, backend: str, model: str) -> str:
    blob = json.dumps([caption, type_, variant, prompt_version, backend, model], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class AnswerCache:
    def __init__(self, path: str | os.PathLike, fsync_every: int = 64):
        self.path = Path(path)
        self.fsync_every = fsync_every
        self.records: dict[str, tuple] = {}     # key -> (text, error)
        self.corrupt_lines = 0
        self._fd: int | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    self.records[rec["key"]] = (rec.get("text"), rec.get("error"))
                except (ValueError, KeyError, TypeError):
                    self.corrupt_lines += 1

    def __contains__(self, key: str) -> bool:
        return key in self.records

    def get(self, key: str) -> dict | None:
        """{"text", "error"} of the key's last answer, or None."""
        got = self.records.get(key)
        return None if got is None else {"text": got[0], "error": got[1]}

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode()
        with self._lock:
            if self._fd is None:
                self._open()
            os.write(self._fd, line)
            self.records[record["key"]] = (record.get("text"), record.get("error"))
            self._pending += 1
            if self._pending >= self.fsync_every:
                os.fsync(self._fd)
                self._pending = 0

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":   # a killed writer left half a line: close it off
                    os.write(self._fd, b"\n")

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
