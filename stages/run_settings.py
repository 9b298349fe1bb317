"""Stage `run_settings`: every run's effective settings -> data/runs/<run>.json (clipfinetune/runs.py `resolve_runs`).

train@<run> depends on data/runs/<its run>.json instead of declaring params: a `foreach` cannot declare one run's
`loss.*` keys, so this stage declares `loss`, `runs`, `train` and `model.precision` whole and writes each run's
resolved settings (its method, constructor kwargs, merged training settings, precision) as deterministic bytes.
`dvc exp run -S loss.lambda_l=0.2` re-runs this stage (a second), which rewrites only the files of the runs whose
settings change; DVC then re-trains exactly those runs. Each file also carries the run's code: a digest of the
import closure of every method the run loads (`Method.methods_run`: its own; the mix, the methods it names; its dep
data/code/methods holds stage code's digests of the same files), so an edited loss re-trains the runs that load it,
and a new method module none that exists.
Run by hand: python stages/run_settings.py --stage run_settings
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import start

from clipfinetune.io import write_json
from clipfinetune.runs import resolve_runs

OUT = "data/runs"


def resolved(params) -> dict[str, dict]:
    """The declared params as the nested mapping `resolve_runs` takes."""
    return resolve_runs({"loss": params["loss"], "runs": params["runs"], "train": params["train"],
                         "model": {"precision": params["model.precision"]}})


def run_code(settings: dict) -> dict[str, str]:
    """{method: md5 of its code digest} for every method the run loads: the same content as stage code's
    data/code/methods/<method>.json (this stage's dep), computed here so a run by hand needs no other stage."""
    import hashlib
    import json

    from clipfinetune.methods import get_method
    from clipfinetune.project.deps import digests, method_closure

    methods = sorted(set(get_method(settings["method"]).methods_run(settings["config"])))
    return {m: hashlib.md5(json.dumps(digests(method_closure(m)), sort_keys=True).encode()).hexdigest()
            for m in methods}


def main() -> None:
    _, params, log = start(__doc__, "run_settings")
    try:
        runs = resolved(params)
    except ValueError as e:              # a typo'd key, an unknown method, a clash: named, no traceback
        raise SystemExit(f"stage {params.stage}: {e}") from None
    for run, settings in runs.items():
        write_json(f"{OUT}/{run}.json", {**settings, "code": run_code(settings)})
        log.info("%s: %s %s", run, settings["method"], settings["config"])
    params.check_all_read()


if __name__ == "__main__":
    main()
