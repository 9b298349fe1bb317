"""Stage `method_code`: each method's code -> data/code/<method>.json ({file: md5} of `clipfinetune.deps.method_closure`).

train@<run> depends on data/code/<its method>.json instead of every method's files (a foreach cannot list one run's
files): an edited loss file changes only the digests of the methods that import it (its own; `custom`, which mixes
them all), so `dvc repro` re-trains only their runs. The stage itself depends on every method's files; it reads each
once (milliseconds). Run by hand: python stages/method_code.py --stage method_code
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import ROOT, start

from clipfinetune.deps import method_closure
from clipfinetune.io import write_json
from clipfinetune.registry import METHODS, MIX

OUT = "data/code"


def digest(rel: str) -> str:
    path = ROOT / rel
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.md5()
    for f in files:             # a data folder (e.g. models/configs): each file's path and bytes
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def main() -> None:
    _, params, log = start(__doc__, "method_code")
    for method in (*METHODS, MIX):
        files = method_closure(method)
        write_json(f"{OUT}/{method}.json", {rel: digest(rel) for rel in files})
        log.info("%s: %d files", method, len(files))
    params.check_all_read()


if __name__ == "__main__":
    main()
