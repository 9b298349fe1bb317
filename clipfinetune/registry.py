"""The one list of what exists: the methods and the runs that train them.

A method is a name in METHODS plus its files (clipfinetune/methods/<name>.py, clipfinetune/losses/<name>.py); a
run is a `train@<run>` stage: each method's own run, the papers' ablations (a run of a method with its own loss
weights, params `ablations.<run>`) and the `custom` mix of the methods' terms. The evaluated models are `base` and
every run. What else lists them is derived from these lines (`methods.get_method`, `custom`'s terms from each
method's `terms`, benchmarks/fig2_methods.py) or checked against them by tests/test_registry.py (params.yaml `runs`,
`eval.models` and `ablations`, the report's claims). dvc.yaml lists none: it iterates params `runs` and `eval.models`.
"""
from __future__ import annotations

METHODS = ("clip", "harmoclip", "fsc_clip", "goal", "degla", "mulclip")
ABLATIONS = {"fsc_lhn_only": "fsc_clip", "fsc_global_only": "fsc_clip", "goal_global_only": "goal",
             "degla_no_distill": "degla", "mulclip_global_only": "mulclip"}
MIX = "custom"                      # the method that sums other methods' terms by name

RUNS: dict[str, str] = {**{m: m for m in METHODS}, **ABLATIONS, MIX: MIX}     # run -> its method
MODELS = ("base", *RUNS)            # every evaluated model: the base before fine-tuning, then every run
