"""The papers' recipes and other parameter profiles, written into params.yaml.

    clipfinetune recipe <paper> [--params params.yaml] [--base REF] [--dry-run]
        # or python -m clipfinetune.project.profile recipe
    python -m clipfinetune.project.profile apply <profile.yaml>... [--params params.yaml] [--dry-run]

`recipe <paper>` writes params.yaml = the COMMITTED params.yaml (`git show HEAD:params.yaml`: the sample world's)
+ params.real.yaml (the shared real-data base) + recipes/<paper>.yaml. It is built from the committed file, never
from the workspace's, so it is idempotent and independent of order: recipe A then recipe B writes exactly what
recipe B alone writes (nothing of A is left over: no data stage's sources, eval set, run or loss weight). If HEAD's
params.yaml is itself a real-data profile (someone committed an applied recipe), the newest commit whose params.yaml
is the sample world's is the base instead, and the command names it (`--base REF` chooses another).

The user's own edits are never lost silently. A workspace value that differs from what the workspace was last set
to (the committed params.yaml, or the recipe its `eval.report.paper` names) is an edit, e.g. left by `dvc exp run -S
compute.nproc=4`: an edit of a key that no recipe sets (compute.*, sample.*, ...) is kept; an edit of a key that a
recipe sets (the keys of params.real.yaml + any recipes/*.yaml) is replaced by the recipe's value, and the command
lists each one with the `-S` that re-applies it. Recipes own those keys because a leftover of one would silently
change another paper's run; a kept edit cannot break order independence, as no recipe sets its key.

Merge rule (`recipe` and `apply`): mappings merge key by key, except the WHOLE units, which a profile replaces whole:
`runs` (a recipe names its paper's runs and no other) and each task's sets `eval.evalsets.<task>` (the sets named
are every set of the task it scores; params.real.yaml names every task, so no sample-world set is scored on a real
model). Scalars and lists replace; keys new to params.yaml are added.

Writing: the result keeps the comments and layout of the file it is built from, and the written text is parsed back
and compared with the intended merge (plain dicts) before it replaces params.yaml. `dvc exp run -S` rewrites
params.yaml with its own ruamel settings (block lists, comments moved into the list); merging into that form once
emitted `shards: maxcount: 5000` on one line (a stale comment slot of a replaced list). So lists of scalars get
their flow style back and a replaced value's comment slots are dropped; should the text still not load back equal,
params.yaml is written without comments (and the command says so), never wrong.

This module reads only the files its command line names (and the committed params.yaml through git); the library
never reads params.yaml itself.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import subprocess
import sys
from pathlib import Path

from clipfinetune.keys import BothSpellings, respell

REAL = "params.real.yaml"
RECIPES = "recipes"
# replaced whole by a profile, never merged key by key (key paths, `*` = any one key)
WHOLE = (("runs",), ("eval", "evalsets", "*"))


def _yaml():
    from ruamel.yaml import YAML

    y = YAML()                     # round-trip: comments, order and flow style survive
    y.preserve_quotes = True
    y.width = 120
    return y


def load(path) -> dict:
    """A params/profile file as ruamel's round-trip tree (comments kept)."""
    with open(path) as f:
        return loads(f.read(), str(path))


def loads(text: str, where: str = "params") -> dict:
    tree = respell(_yaml().load(text) or {}, where)
    _restyle(tree)
    return tree


def load_plain(path) -> dict:
    return _safe_load(Path(path).read_text(), str(path))


def _safe_load(text: str, where: str = "params") -> dict:
    """Plain dicts, read as DVC reads params.yaml (ruamel, YAML 1.2: `2e-05`, as `dvc exp run -S` writes it, is a
    float; PyYAML's YAML 1.1 would read a string and write it back quoted). Every reader of a params or profile file
    goes through here or `loads`, so a key's older spelling (keys.RENAMED: `eval.benchmarks`) is read as the current
    one, and written so."""
    from ruamel.yaml import YAML

    return respell(YAML(typ="safe").load(text) or {}, where)


def _is_whole(path: tuple, whole=WHOLE) -> bool:
    return any(len(p) == len(path) and all(a in ("*", b) for a, b in zip(p, path)) for p in whole)


def deep_merge(base: dict, overlay: dict, prefix: str = "", whole: tuple = (), _path: tuple = ()) -> list[str]:
    """Merge `overlay` into `base` in place (the units `whole` names replaced, not merged); returns the dotted
    keys whose value changed or was added."""
    changed = []
    for key, value in overlay.items():
        path = (*_path, key)
        if isinstance(value, dict) and value and isinstance(base.get(key), dict) and not _is_whole(path, whole):
            changed += deep_merge(base[key], value, f"{prefix}{key}.", whole, path)
        elif key not in base or base[key] != value:
            _forget_value_comments(base, key)
            base[key] = value
            changed.append(f"{prefix}{key}")
    return changed


def leaves(d: dict, whole: tuple = (), _path: tuple = ()):
    """(key path, value) for every leaf; an empty mapping and a `whole` unit are leaves."""
    for key, value in d.items():
        path = (*_path, key)
        if isinstance(value, dict) and value and not _is_whole(path, whole):
            yield from leaves(value, whole, path)
        else:
            yield path, value


def flatten(d: dict, prefix: str = "", whole: tuple = ()):
    """(dotted key, value) for every leaf; an empty mapping and a `whole` unit are leaves."""
    for path, value in leaves(d, whole):
        yield prefix + ".".join(map(str, path)), value


def _get(d: dict, key, default=None):
    """The value at a dotted key or a key path."""
    node = d
    for part in key.split(".") if isinstance(key, str) else key:
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _set(d: dict, path: tuple, value) -> None:
    *parents, leaf = path
    for part in parents:
        if not isinstance(d.get(part), dict):
            d[part] = {}
        d = d[part]
    _forget_value_comments(d, leaf)
    d[leaf] = value


def merged(profile_paths) -> dict:
    """Several profiles merged in order (a later one wins; WHOLE units replaced), as plain dicts."""
    paths = [profile_paths] if isinstance(profile_paths, (str, Path)) else profile_paths
    return layered({}, *(load_plain(path) for path in paths))


def layered(base: dict, *profiles: dict) -> dict:
    """A copy of `base` with the profiles merged into it in order (WHOLE units replaced)."""
    out = copy.deepcopy(base)
    for overlay in profiles:
        deep_merge(out, copy.deepcopy(overlay), whole=WHOLE)
    return out


# ------------------------------------------------------------------------------------------------ the writer
def _restyle(node) -> None:
    """Lists of scalars back in flow style, their comments on the key's line (the form params.yaml is committed in;
    `dvc exp run -S` writes them as block lists with the comment moved into the list)."""
    from ruamel.yaml.comments import CommentedMap, CommentedSeq

    if isinstance(node, CommentedMap):
        for key, value in node.items():
            if isinstance(value, CommentedSeq) and value and not value.fa.flow_style() \
                    and not any(isinstance(v, (dict, list)) for v in value):
                value.fa.set_flow_style()
                value.ca.comment = None
                value.ca.items.clear()
                _forget_value_comments(node, key)
            _restyle(value)
    elif isinstance(node, list):
        for value in node:
            _restyle(value)


def _forget_value_comments(mapping, key) -> None:
    """Drop the comment slot ruamel keeps for a block value's first line (mapping.ca.items[key][3]): once the value
    is replaced, a stale slot makes the emitter write the next top-level key's mapping on that key's line."""
    ca = getattr(mapping, "ca", None)
    item = ca.items.get(key) if ca is not None else None
    if item is not None and len(item) > 3:
        item[3] = None


def dumps(tree: dict, intended: dict) -> tuple[str, bool]:
    """(the text of `tree`, whether its comments were kept): the round-trip text if it loads back equal to
    `intended`, else a plain dump of `intended` (comments lost, values right)."""
    from ruamel.yaml import YAMLError

    out = io.StringIO()
    _yaml().dump(tree, out)
    text = out.getvalue()
    try:
        if _safe_load(text) == intended:
            return text, True
    except YAMLError:
        pass
    import yaml

    # PyYAML writes floats with a '.' (1.0e-06), which YAML 1.1 and 1.2 readers agree on
    return yaml.safe_dump(intended, sort_keys=False, default_flow_style=None, width=120), False


def write(path, tree: dict, intended: dict) -> bool:
    """Write `tree` to `path` atomically, checked against `intended`; returns whether comments were kept."""
    from clipfinetune.io import atomic_path

    text, kept = dumps(tree, intended)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(text)
    return kept


# ------------------------------------------------------------------------------------------------ apply
def apply(profile_paths, params_path="params.yaml", dry_run: bool = False) -> list[str]:
    """Merge profiles into params_path in place (WHOLE units replaced); returns the dotted keys that changed."""
    paths = [profile_paths] if isinstance(profile_paths, (str, Path)) else list(profile_paths)
    tree = load(params_path)
    intended = load_plain(params_path)
    deep_merge(intended, merged(paths), whole=WHOLE)
    overlay: dict = {}
    for path in paths:
        deep_merge(overlay, load(path), whole=WHOLE)
    changed = deep_merge(tree, overlay, whole=WHOLE)   # the profiles first: a key a later one resets is no change
    if not dry_run and not write(params_path, tree, intended):
        print(f"{params_path}: written without comments (the commented text did not load back equal)",
              file=sys.stderr)
    return changed


# ------------------------------------------------------------------------------------------------ recipe
def is_real_profile(params: dict) -> bool:
    """A params file with the real-data base applied (params.real.yaml takes the sample world out of the DAG)."""
    return _get(params, "sample.build", ["world"]) == []


def recipes(root) -> dict[str, tuple[Path, dict]]:
    """paper -> (recipes/<paper>.yaml, its content): the profiles in recipes/ that name their paper
    (`eval.report.paper`)."""
    out = {}
    for path in sorted(Path(root, RECIPES).glob("*.yaml")):
        content = load_plain(path)
        if _get(content, "eval.report.paper") == path.stem:
            out[path.stem] = (path, content)
    return out


def _owned(path: tuple, owned: set[tuple]) -> bool:
    return any(path[:i] in owned for i in range(1, len(path) + 1))


def _git(root, *args) -> str:
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"git {' '.join(args)} failed in {root}: {proc.stderr.strip()}")
    return proc.stdout


def committed_base(params_path, ref: str | None = None) -> tuple[str, str]:
    """(the committed params.yaml text a recipe is applied over, the commit it comes from): `ref`'s, else HEAD's,
    else (HEAD's is a real-data profile) the newest commit of HEAD's history whose params.yaml is the sample world's."""
    params_path = Path(params_path).resolve()
    root, name = params_path.parent, params_path.name
    candidates = [ref] if ref else ["HEAD"] + _git(root, "log", "--format=%H", "--", name).split()
    for commit in candidates:
        text = _git(root, "show", f"{commit}:./{name}")
        if ref or not is_real_profile(_safe_load(text)):
            return text, _git(root, "rev-parse", "--short", commit).strip()
    raise SystemExit(f"no commit of {root} holds a sample-world {name} (every one has params.real.yaml applied): "
                     "name the base with --base REF")


ABSENT = object()         # a key the params do not hold


def recipe(paper: str, params_path="params.yaml", base_ref: str | None = None, dry_run: bool = False) -> dict:
    """Write params.yaml = committed base + params.real.yaml + recipes/<paper>.yaml + the workspace's edits of keys
    no recipe sets. Returns {"base": commit, "changed": keys that differ from the base, "kept": {key: value},
    "replaced": {key: (workspace value, new value)}, "comments": kept or not}."""
    params_path = Path(params_path)
    root = params_path.resolve().parent
    found = recipes(root)
    if paper not in found:
        raise SystemExit(f"no recipe {paper!r} in {root / RECIPES} (recipes: {', '.join(found)})")
    real = load_plain(root / REAL)
    text, commit = committed_base(params_path, base_ref)
    base = _safe_load(text, f"{params_path} at {commit}")
    applied = {name: layered(base, real, content) for name, (_, content) in found.items()}
    intended = applied[paper]
    changed = deep_merge(copy.deepcopy(base), layered({}, real, found[paper][1]), whole=WHOLE)
    tree = loads(text, f"{params_path} at {commit}")
    for path in (root / REAL, found[paper][0]):
        deep_merge(tree, load(path), whole=WHOLE)

    # the workspace's edits: its values that differ from what it was last set to (the committed params, or the
    # recipe it names); recipes own every key params.real.yaml or a recipe sets
    workspace = load_plain(params_path) if params_path.is_file() else base
    last = _get(workspace, "eval.report.paper")
    reference = applied.get(last) or (layered(base, real) if is_real_profile(workspace) else base)
    owned = set().union(*({k for k, _ in leaves(layered({}, real, content), whole=WHOLE)}
                          for _, content in found.values()))
    kept, replaced = {}, {}
    for path, value in leaves(workspace):
        if _get(reference, path, ABSENT) == value:
            continue
        key = ".".join(map(str, path))
        if _owned(path, owned):
            new = _get(intended, path, ABSENT)
            if new != value:
                replaced[key] = (value, new)
        else:
            kept[key] = value
            _set(intended, path, copy.deepcopy(value))
            _set(tree, path, copy.deepcopy(value))
    comments = True if dry_run else write(params_path, tree, intended)
    return {"base": commit, "changed": changed, "kept": kept, "replaced": replaced, "comments": comments}


def _hydra(value) -> str:
    """A value as `dvc exp run -S key=<value>` takes it (Hydra's override grammar)."""
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


def _report_recipe(paper: str, params: str, out: dict, dry_run: bool) -> str:
    verb = "would write" if dry_run else "wrote"
    lines = [(f"{params}: {verb} the committed params.yaml ({out['base']}) + {REAL} + {RECIPES}/{paper}.yaml "
              f"({len(out['changed'])} keys differ from the committed file)")]
    if out["kept"]:
        lines.append(f"kept {len(out['kept'])} workspace edit(s) of keys no recipe sets:")
        lines += [f"  {k}: {json.dumps(v)}" for k, v in out["kept"].items()]
    if out["replaced"]:
        lines.append(f"replaced {len(out['replaced'])} workspace edit(s) of keys the recipes set (re-apply with "
                     f"`dvc exp run -n {paper} -S ...` if you meant them for this paper):")
        lines += [f"  {k}: {json.dumps(old)} -> {'(none)' if new is ABSENT else json.dumps(new)}   "
                  f"-S '{k}={_hydra(old)}'" for k, (old, new) in out["replaced"].items()]
    if not out["comments"]:
        lines.append(f"{params}: written without comments (the commented text did not load back equal)")
    if not dry_run:
        lines.append(f"next: clipfinetune plan, then dvc exp run -n {paper}")
    return "\n".join(lines)


def main(argv=None, prog: str = "python -m clipfinetune.project.profile") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    add_recipe_arguments(sub.add_parser("recipe", help="write params.yaml for one paper (recipes/<paper>.yaml)"))
    a = sub.add_parser("apply", help="merge profiles into a params file in place (comments kept)")
    a.add_argument("profile", nargs="+")
    a.add_argument("--params", default="params.yaml")
    a.add_argument("--dry-run", action="store_true", help="only list the keys that would change")
    args = p.parse_args(argv)
    try:
        if args.cmd == "recipe":
            return run_recipe(args)
        changed = apply(args.profile, args.params, args.dry_run)
    except BothSpellings as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    verb = "would change" if args.dry_run else "changed"
    print(f"{args.params}: {verb} {len(changed)} keys" + "".join(f"\n  {k}" for k in changed))
    return 0


def add_recipe_arguments(parser) -> None:
    parser.add_argument("paper", help="a recipe of recipes/: its file name without .yaml")
    parser.add_argument("--params", default="params.yaml", help="the params file to write (default: params.yaml)")
    parser.add_argument("--base", default=None, help="the commit whose params.yaml the recipe is applied over "
                                                      "(default: HEAD, or the newest with the sample world's)")
    parser.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")


def run_recipe(args) -> int:
    out = recipe(args.paper, args.params, args.base, args.dry_run)
    print(_report_recipe(args.paper, args.params, out, args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
