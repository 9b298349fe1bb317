"""The evaluation sets as files: one reader per benchmark format (a module each) and `sets.read_set`, which says which
reader each task of params `eval.evalsets` uses.

Below both the evaluation (`clipfinetune.eval`, which scores what `read_set` returns) and the leakage check
(`clipfinetune.leakage`, which compares the images it lists with the training images), so neither imports the other,
and the `shards` and `evalsets` stages' code is these readers, not the evaluation or the model.
"""
