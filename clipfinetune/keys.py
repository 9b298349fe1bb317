"""Dotted keys into nested mappings: `lookup(params, "eval.evalsets.zeroshot")` is params["eval"]["evalsets"]
["zeroshot"] (params.yaml, a stage's declared params, metrics files, profile overlays)."""
from __future__ import annotations

MISSING = object()


def lookup(tree, key: str, default=MISSING):
    """The value at dotted `key` in nested dicts; `default` when a part is absent or its parent is no dict, else a
    KeyError naming the key."""
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is MISSING:
                raise KeyError(key)
            return default
        node = node[part]
    return node
