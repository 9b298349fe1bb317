"""The methods, discovered: a method is its files (clipfinetune/methods/<name>.py, clipfinetune/losses/<name>.py),
and nothing lists it by hand, so adding one edits no file that an existing method's runs load (their code digests,
data/code/methods/<method>.json, stay the same: clipfinetune/project/deps.py).

METHODS: every module of clipfinetune/methods/ except `base` (the protocol), the mix MIX and `_`-prefixed helpers,
the baseline `clip` first, then by name. The runs are not listed here: each is one entry of params.yaml `runs` (its
method and what it changes, resolved by clipfinetune/runs.py), the one list of runs. dvc.yaml makes train@<run> and
eval@<run> for each entry (`foreach: ${runs}`) and `eval_base` for the model before fine-tuning; `report` reads the
same entries. A recipe (recipes/<method>.yaml) replaces the whole mapping with its paper's runs, so only those are
trained and evaluated.
"""
from __future__ import annotations

from pathlib import Path

MIX = "custom"                      # the method that sums other methods' terms by name
BASELINE = "clip"                   # plain CLIP fine-tuning: every paper's baseline, listed first
NOT_METHODS = frozenset({"base", MIX})


def discover(folder: Path = Path(__file__).parent / "methods") -> tuple[str, ...]:
    """The method modules of `folder`: the baseline first, then by name."""
    names = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_") and p.stem not in NOT_METHODS)
    return tuple(sorted(names, key=lambda n: n != BASELINE))


METHODS = discover()
