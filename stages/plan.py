"""Stage plan@repro: `clipfinetune plan` as the first stage of every `dvc repro` / `dvc exp run` of a configuration
that lists it (params `plan.check: [repro]`, as params.real.yaml does; `[]` leaves it out, as on the sample world).

It resolves the applied params.yaml on the GPUs this host shows (clipfinetune/project/plan/, docs/scale.md) and exits 1
with the plan's table and refusals (the param to change, values that work) when a stage would stop or silently
degrade later: a batch the ranks cannot split, a run reading a table no stage writes, a vLLM server sharing a card
with the ranks, a real model scored on the sample world's sets, an epoch that misses units, a missing input. Every
other stage depends on data/plan, so nothing runs before it; its output, data/plan/passed.json, is the same file
whenever the plan passes, so a passing plan re-runs nothing (always_changed, as `evalsets`).
Run by hand: python stages/plan.py --stage plan@repro (or `clipfinetune plan`, which prints the same table).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import ROOT, start

OUT = ROOT / "data" / "plan" / "passed.json"


def main() -> None:
    _, params, log = start(__doc__, "plan@repro")
    from clipfinetune.io import write_json
    from clipfinetune.project import plan

    if plan.main(["--params", str(ROOT / "params.yaml"), "--root", str(ROOT)]) != 0:
        raise SystemExit("plan@repro: refused (above: the param to change and values that work); nothing else ran. "
                         "`clipfinetune plan` prints the same table.")
    write_json(OUT, {"passed": True})
    log.info("the plan passed: the other stages may run")
    params.check_all_read()


if __name__ == "__main__":
    main()
