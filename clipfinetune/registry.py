"""The one list of methods: a method is a name in METHODS plus its files (clipfinetune/methods/<name>.py,
clipfinetune/losses/<name>.py).

The runs are not listed here: each is one entry of params.yaml `runs` (its method and what it changes, resolved by
clipfinetune/runs.py), the one list of runs. dvc.yaml makes train@<run> and eval@<run> for each entry
(`foreach: ${runs}`) and `eval_base` for the model before fine-tuning; `report` reads the same entries. A recipe
(recipes/<method>.yaml) replaces the whole mapping with its paper's runs, so only those are trained and evaluated.
"""
from __future__ import annotations

METHODS = ("clip", "harmoclip", "fsc_clip", "goal", "degla", "mulclip")
MIX = "custom"                      # the method that sums other methods' terms by name
