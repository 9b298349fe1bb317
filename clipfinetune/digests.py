"""Content digests of files (BLAKE2b), cached by (path, size, mtime) in one SQLite file: the leakage check's content
test and the evaluation-set manifest hash a file once, and a re-check costs one stat per file."""
from __future__ import annotations

import hashlib
import os
import sqlite3
from pathlib import Path

DIGEST_CACHE = Path("data/cache/leakage")   # the project's digest cache (stages shards and evalsets, validate)


class DigestCache:
    """BLAKE2b digests of files keyed by (path, size, mtime_ns) in one SQLite file (each insert commits, so a
    killed check keeps what it hashed). `cache_dir=None` keeps them in memory only."""

    def __init__(self, cache_dir=None):
        if cache_dir is not None:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(":memory:" if cache_dir is None else str(Path(cache_dir) / "digests.sqlite"))
        self.db.execute("CREATE TABLE IF NOT EXISTS digest (path TEXT PRIMARY KEY, size INT, mtime INT, hex TEXT)")
        self.hashed = self.reused = 0

    def digest(self, path: str, st: os.stat_result) -> str:
        key = str(Path(path).resolve())
        row = self.db.execute("SELECT size, mtime, hex FROM digest WHERE path = ?", (key,)).fetchone()
        if row and row[0] == st.st_size and row[1] == st.st_mtime_ns:
            self.reused += 1
            return row[2]
        with open(path, "rb") as f:
            hexdigest = hashlib.file_digest(f, "blake2b").hexdigest()
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO digest VALUES (?, ?, ?, ?)",
                            (key, st.st_size, st.st_mtime_ns, hexdigest))
        self.hashed += 1
        return hexdigest

    def close(self) -> None:
        self.db.close()
