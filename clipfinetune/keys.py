"""Dotted keys into nested mappings: `lookup(params, "eval.evalsets.zeroshot")` is params["eval"]["evalsets"]
["zeroshot"] (params.yaml, a stage's declared params, metrics files, profile overlays); `respell` reads a renamed
key's older spelling as the current one."""
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


# params keys that were renamed, older spelling -> current one (the evaluation sets were `eval.benchmarks`): a recipe,
# a profile or a params.yaml written before the rename still reads
RENAMED = {"eval.benchmarks": "eval.evalsets"}


class BothSpellings(ValueError):
    """A renamed key given under both spellings in one file."""


def respell(tree, where: str = "params"):
    """`tree` (nested mappings, changed in place) with each key of RENAMED under its current spelling, in the older
    key's place (a ruamel mapping keeps its order and comments). `BothSpellings` naming `where` and both keys when the
    two are both given: which one is meant cannot be told."""
    for old, new in RENAMED.items():
        parent_key, old_name = old.rsplit(".", 1)
        new_parent, new_name = new.rsplit(".", 1)
        assert parent_key == new_parent, "a rename within one mapping"
        parent = lookup(tree, parent_key, None)
        if not isinstance(parent, dict) or old_name not in parent:
            continue
        if new_name in parent:
            raise BothSpellings(f"{where}: both {old} (the older spelling) and {new} are given; keep {new} only")
        _rename_in_place(parent, old_name, new_name)
    return tree


def _rename_in_place(mapping: dict, old: str, new: str) -> None:
    position = list(mapping).index(old)
    if hasattr(mapping, "insert"):                       # ruamel's CommentedMap: its comments move with the key
        comment = mapping.ca.items.pop(old, None)
        mapping.insert(position, new, mapping.pop(old))
        if comment is not None:
            mapping.ca.items[new] = comment
        return
    items = [(new if key == old else key, value) for key, value in mapping.items()]
    mapping.clear()
    mapping.update(items)
