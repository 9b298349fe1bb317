"""Stage `code`: every stage's and every method's code -> data/code/{stages,methods}/<name>.json ({file: md5}).

dvc.yaml lists no code file: each stage depends on data/code/stages/<its script>.json, the content digest of what its
script imports (`clipfinetune.project.deps.stage_closure`), and each run on its method's data/code/methods/<method>.json
through data/runs/<run>.json (stage run_settings). This stage depends on the `clipfinetune` and `stages` folders
whole and parses each file once (seconds; it imports none of them): an edit rewrites only the digests of the stages
and methods that load the file, so `dvc repro` then re-runs exactly those.
Run by hand: python stages/code.py --stage code
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import start

from clipfinetune.io import write_json
from clipfinetune.project.deps import CODE_DIR, code_files


def main() -> None:
    _, params, log = start(__doc__, "code")
    files = code_files()
    for rel, content in files.items():
        write_json(f"{CODE_DIR}/{rel}", content)
    log.info("%d digests (%d stages, %d methods)", len(files), sum(r.startswith("stages/") for r in files),
             sum(r.startswith("methods/") for r in files))
    params.check_all_read()


if __name__ == "__main__":
    main()
