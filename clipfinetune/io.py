"""Atomic outputs and clear input errors, shared by every stage."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


class InputError(ValueError):
    """Bad input that cannot be skipped: names the file and the record."""

    def __init__(self, path: str | os.PathLike, record: Any, message: str):
        self.path, self.record = str(path), record
        super().__init__(f"{path}: record {record!r}: {message}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; rename it over `path` only if the block succeeds.

    A killed process leaves at most a `.tmp-*` sibling, never a half-written `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent)) if is_dir else \
        path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        yield tmp
        if is_dir and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n")


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_parquet(path: str | os.PathLike, frame) -> None:
    """Deterministic parquet (no pandas index, fixed writer) written atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = frame if isinstance(frame, pa.Table) else pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata(None)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, (np.ndarray,)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")
