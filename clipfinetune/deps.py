"""Each stage's code deps in dvc.yaml are the files its script imports, so an edit re-runs only the stages it touches.

    python -m clipfinetune.deps            # print, per stage, the code deps dvc.yaml lacks (+) or has in excess (-)
    python -m clipfinetune.deps --write    # rewrite those lists in dvc.yaml (comments, order of other deps kept)

A stage's import closure: every `import` / `from ... import` statement (at any depth: the stages import lazily inside
`main`) of `stages/<stage>.py`, followed through the stages' helpers (`stages/_common.py`, `stages/_items.py`) and every clipfinetune module it reaches, with
each package's `__init__.py` (importing a submodule runs it) and the data files a module reads (RESOURCES). The
code deps of dvc.yaml are the entries under `stages/` and `clipfinetune/`; data deps are never touched.

Runtime imports by name are not statements: `methods.get_method(name)` loads `clipfinetune/methods/<name>.py`. A
foreach cannot give one run a list of files of its own, so a method's code reaches its runs through one file: stage
`method_code` (its deps: every method's files, RUNTIME_DIRS) writes data/code/<method>.json, the content digest of
that method's closure (`method_closure`: its module and what it imports; `custom`, the mix, loads every method), and
train@<run> depends on data/code/<its method>.json: an edited loss re-trains that method's runs (and the mix's), no
other. tests/test_stage_deps.py checks dvc.yaml against this module both ways.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "clipfinetune"
# data files a module reads next to itself (Path(__file__).parent / ...)
RESOURCES = {
    "clipfinetune/models/loading.py": ["clipfinetune/models/configs"],
    "clipfinetune/data/prepare/word_regions.py": ["clipfinetune/data/prepare/chair_synonyms.txt"],
    "clipfinetune/data/negatives/degla/llm.py": ["clipfinetune/data/negatives/degla/fewshot"],
    "clipfinetune/eval/box_cls.py": ["clipfinetune/eval/templates"],
}
# folders whose modules are loaded by name at run time, declared whole (with everything their files import):
# by any stage that imports the module on the left (`readers.reader(name)` for a source's reader) ...
RUNTIME = {"clipfinetune/data/readers/__init__.py": ["clipfinetune/data/readers"]}
# ... and by the stage on the left (train@<run>: `methods.get_method(name)`; `custom` loads every method)
RUNTIME_DIRS = {"method_code": ["clipfinetune/methods", "clipfinetune/losses"]}


def _module_file(dotted: str) -> Path | None:
    """clipfinetune.a.b -> clipfinetune/a/b.py or clipfinetune/a/b/__init__.py (None: not one of ours)."""
    if dotted != PACKAGE and not dotted.startswith(PACKAGE + "."):
        return None
    base = ROOT.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _with_parents(path: Path) -> set[Path]:
    """A module and the `__init__.py` of every package above it (Python runs them first)."""
    out = {path}
    folder = path.parent
    while folder != ROOT and (folder / "__init__.py").is_file():
        out.add(folder / "__init__.py")
        folder = folder.parent
    return out


def _stage_helper(name: str) -> Path | None:
    """`stages/_<x>.py` for `stages._<x>`: the stages' shared helpers (`_common`, `_items`)."""
    package, _, module = name.rpartition(".")
    path = ROOT / "stages" / f"{module}.py"
    return path if package == "stages" and module.startswith("_") and path.is_file() else None


def module_imports(path: Path) -> set[Path]:
    """The project files one file's import statements name (module level and inside functions alike): each imported
    module, or the submodule a `from pkg import name` names, without the packages above them."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]) if path.name != "__init__.py" else \
        ".".join(path.relative_to(ROOT).parent.parts)
    found: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (helper := _stage_helper(alias.name)) is not None:
                    found.add(helper)
                elif (f := _module_file(alias.name)) is not None:
                    found.add(f)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                stem = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{stem}.{node.module}" if node.module else stem
            else:
                module = node.module or ""
            helpers = [_stage_helper(f"{module}.{alias.name}") for alias in node.names] + [_stage_helper(module)]
            if any(helpers):                                       # `from stages import _items`, `from stages._common`
                found |= {h for h in helpers if h is not None}
                continue
            f = _module_file(module)
            if f is None:
                continue
            subs = [_module_file(f"{module}.{alias.name}") for alias in node.names]   # `from pkg import submodule`
            found |= {sub for sub in subs if sub is not None}
            if not all(subs):                                                       # ... or a name defined in pkg
                found.add(f)
    return found


def _imports(path: Path) -> set[Path]:
    """The project files one file's import statements load: each module with the `__init__.py` above it."""
    return {p for f in module_imports(path) for p in _with_parents(f)}


def closure(script: str | Path) -> list[str]:
    """Every project file `script` loads by import statements (itself included) and the data files they read,
    as sorted repository-relative paths."""
    todo, seen = [ROOT / script], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo.extend(_imports(path) - seen)
    rel = {p.relative_to(ROOT).as_posix() for p in seen}
    for module, files in RESOURCES.items():
        if module in rel:
            rel |= set(files)
    return sorted(rel)


def method_closure(method: str) -> list[str]:
    """The files a method's runs execute beyond the train stage's own closure: its module's import closure; the mix
    (`registry.MIX`) loads every paper method by name at run time, so it has all of theirs."""
    from clipfinetune.registry import METHODS, MIX

    files = set(closure(f"{PACKAGE}/methods/{method}.py"))
    for other in METHODS if method == MIX else ():
        files |= set(closure(f"{PACKAGE}/methods/{other}.py"))
    return sorted(files)


def _is_code(dep: str) -> bool:
    return dep.startswith(("stages/", f"{PACKAGE}/"))


def stage_script(body: dict) -> str:
    """The script a stage runs: the `stages/<x>.py` of its cmd."""
    (script,) = [w for w in body["cmd"].split() if w.startswith("stages/") and w.endswith(".py")]
    return script


def expected_code_deps(name: str, body: dict) -> list[str]:
    """The stage script's closure, with each runtime folder it loads by name as one dep (and its files' closure)."""
    files, folders, done = set(closure(stage_script(body))), set(RUNTIME_DIRS.get(name, [])), set()
    while True:
        folders |= {d for module, dirs in RUNTIME.items() if module in files for d in dirs}
        if not folders - done:
            break
        folder = min(folders - done)
        done.add(folder)
        for path in sorted((ROOT / folder).rglob("*.py")):
            files |= set(closure(path.relative_to(ROOT)))
    inside = lambda d: any(d == f or d.startswith(f + "/") for f in folders)
    return sorted({d for d in files if not inside(d)} | folders)


def _bodies(dvc: dict):
    for name, stage in dvc["stages"].items():
        yield name, stage.get("do", stage)


def diff(dvc: dict) -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (code deps dvc.yaml lacks, code deps it has in excess); stages that agree are left out."""
    out = {}
    for name, body in _bodies(dvc):
        if "cmd" not in body:                               # eval_base: the eval body through a YAML merge key
            continue
        declared = [d for d in body.get("deps", []) if isinstance(d, str) and _is_code(d)]
        expected = expected_code_deps(name, body)
        missing, extra = sorted(set(expected) - set(declared)), sorted(set(declared) - set(expected))
        if missing or extra:
            out[name] = (missing, extra)
    return out


def write(path: Path = ROOT / "dvc.yaml") -> dict:
    """Rewrite each stage's code deps in dvc.yaml to its closure: the stage script first, then the rest sorted,
    the data deps after them as they were."""
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq

    y = YAML()
    y.preserve_quotes = True
    y.width = 120
    y.indent(mapping=2, sequence=4, offset=2)
    dvc = y.load(path.read_text())
    changes = diff(dvc)
    for name, body in _bodies(dvc):
        if name not in changes or getattr(body, "merge", None):    # eval_base: follows the eval body it merges
            continue
        script = stage_script(body)
        code = [script] + [d for d in expected_code_deps(name, body) if d != script]
        old = body["deps"]
        data = [i for i, d in enumerate(old) if not (isinstance(d, str) and _is_code(d))]
        new = CommentedSeq(code + [old[i] for i in data])
        for j, i in enumerate(data, start=len(code)):          # a data dep keeps its end-of-line comment
            if i in old.ca.items:
                new.ca.items[j] = old.ca.items[i]
        body["deps"] = new
    tmp = path.with_suffix(".yaml.tmp")
    with open(tmp, "w") as f:
        y.dump(dvc, f)
    tmp.replace(path)
    return changes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clipfinetune.deps", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="rewrite the code deps in dvc.yaml")
    args = p.parse_args(argv)
    import yaml

    changes = write() if args.write else diff(yaml.safe_load((ROOT / "dvc.yaml").read_text()))
    for name, (missing, extra) in changes.items():
        print(f"{name}:" + "".join(f"\n  + {d}" for d in missing) + "".join(f"\n  - {d}" for d in extra))
    print(f"dvc.yaml: {len(changes)} stages {'rewritten' if args.write else 'differ'}")
    return 1 if changes and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
