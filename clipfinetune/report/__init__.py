"""What stage `report` and `stages/seeds.py` make of the evaluations: the summary and the claims with their
paired-bootstrap CIs (`summary`, `bootstrap`), the trade-off plots (`plots`), the seed spread (`seeds`).

A package of its own, outside `clipfinetune/eval` (a dependency of every eval@<model> stage): changing a claim, a
table or a plot re-runs `report` alone. It reads the eval stages' outputs through `clipfinetune.eval.items`.
"""
