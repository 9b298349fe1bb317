"""Parameter profiles: a second params file (e.g. params.real.yaml) deep-merged into params.yaml.

    python -m clipfinetune.profile apply params.real.yaml [recipes/degla.yaml ...] [--params params.yaml] [--dry-run]
    python -m clipfinetune.profile set-args params.real.yaml [recipes/degla.yaml ...]   # as `dvc exp run -S` flags

Several profiles are merged in the order given (a paper's recipe after the shared real-data base).

A profile is a plain params file holding only the keys it changes, at the same paths as in params.yaml (never a
block that shadows them). `apply` rewrites params.yaml in place, keeping its comments and key order: mappings
merge key by key, except the top-level groups in WHOLE (`runs`: a recipe names its paper's runs and no other), which
a profile replaces whole; anything else (scalars, lists) replaces; keys new to params.yaml (e.g. a benchmark set
`eval.benchmarks.retrieval.coco5k`) are added. params.yaml stays the only file DVC reads, so `dvc exp run -S
loss.lambda_l=...`, `dvc params diff` and `dvc exp show` work unchanged afterwards; commit the applied params.yaml
(or run the profile as an experiment: `dvc exp run -n real $(python -m clipfinetune.profile set-args ...)`).

This module reads only the files it is given on the command line (the library never reads params.yaml itself).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _yaml():
    from ruamel.yaml import YAML

    y = YAML()                     # round-trip: comments, order and flow style survive
    y.preserve_quotes = True
    y.width = 120
    return y


def load(path) -> dict:
    with open(path) as f:
        return _yaml().load(f) or {}


WHOLE = ("runs",)                   # top-level groups a profile replaces instead of merging


def deep_merge(base: dict, overlay: dict, prefix: str = "", whole: tuple = ()) -> list[str]:
    """Merge `overlay` into `base` in place (the top-level keys in `whole` replaced, not merged); returns the dotted
    keys whose value changed or was added."""
    changed = []
    for key, value in overlay.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and isinstance(base.get(key), dict) and key not in whole:
            changed += deep_merge(base[key], value, dotted + ".")
        elif key not in base or base[key] != value:
            base[key] = value
            changed.append(dotted)
    return changed


def flatten(d: dict, prefix: str = ""):
    """(dotted key, value) for every leaf; an empty mapping is a leaf."""
    for key, value in d.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _paths(profile_paths) -> list:
    return [profile_paths] if isinstance(profile_paths, (str, Path)) else list(profile_paths)


def merged(profile_paths) -> dict:
    """Several profiles deep-merged in order (a later one wins)."""
    out: dict = {}
    for path in _paths(profile_paths):
        deep_merge(out, load(path), whole=WHOLE)
    return out


def apply(profile_paths, params_path="params.yaml", dry_run: bool = False) -> list[str]:
    params = load(params_path)
    changed = deep_merge(params, merged(profile_paths), whole=WHOLE)     # the profiles first: a key a later one resets is no change
    if not dry_run:
        tmp = Path(str(params_path) + ".tmp")
        with open(tmp, "w") as f:
            _yaml().dump(params, f)
        tmp.replace(params_path)
    return changed


def set_args(profile_paths) -> list[str]:
    """`-S key=value` pairs (Hydra override grammar, values as JSON) for `dvc exp run`; keys new to params.yaml
    need a leading `+`, which the caller adds (`dvc exp run` names such keys in its error)."""
    out = []
    profile = merged(profile_paths)
    for key in WHOLE:                   # one value, not its leaves (Hydra merges a dict into the existing one:
        if key in profile:              # check `dvc exp show` lists only the recipe's runs)
            out += ["-S", f"{key}={_hydra(profile.pop(key))}"]
    for key, value in flatten(profile):
        out += ["-S", f"{key}={_hydra(value)}"]
    return out


def _hydra(value) -> str:
    """A value in Hydra's override grammar (floats keep a '.', so 5e-06 is not read as a string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        text = repr(value)
        mantissa, e, exp = text.partition("e")
        return text if "." in mantissa or not e else f"{mantissa}.0e{exp}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_hydra(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_hydra(v) for v in value) + "]"
    s = str(value)
    return s if s and all(c.isalnum() or c in "_-./:" for c in s) else json.dumps(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clipfinetune.profile", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply", help="deep-merge a profile into params.yaml (in place, comments kept)")
    a.add_argument("profile", nargs="+")
    a.add_argument("--params", default="params.yaml")
    a.add_argument("--dry-run", action="store_true", help="only list the keys that would change")
    s = sub.add_parser("set-args", help="print the profile as `dvc exp run -S` arguments")
    s.add_argument("profile", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "apply":
        changed = apply(args.profile, args.params, args.dry_run)
        verb = "would change" if args.dry_run else "changed"
        print(f"{args.params}: {verb} {len(changed)} keys" + "".join(f"\n  {k}" for k in changed))
        if not args.dry_run:
            print("next: python -m clipfinetune.validate --params " + args.params)
    else:
        print(" ".join(set_args(args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
