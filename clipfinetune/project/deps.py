"""Each stage's code is the files its script imports, so an edit re-runs only the stages it touches.

    python -m clipfinetune.project.deps              # check: no stage body lists a code file, each has its digest
    python -m clipfinetune.project.deps --write      # move any code file dvc.yaml lists into the stage's digest dep
    python -m clipfinetune.project.deps --show train # the files stage script stages/train.py loads

A stage's import closure: every `import` / `from ... import` statement (at any depth: the stages import lazily inside
`main`) of `stages/<stage>.py`, followed through the stages' helpers (`stages/_common.py`, `stages/_items.py`) and
every clipfinetune module it reaches, with each package's `__init__.py` (importing a submodule runs it) and the data
files a module reads (RESOURCES); a folder whose modules load by name (RUNTIME: a source's reader) is taken whole.

dvc.yaml lists no code file: stage `code` (stages/code.py; its deps the `stages` and `clipfinetune` folders) writes
data/code/stages/<script>.json, the content digest of each stage script's closure (`stage_closure`), and each stage
depends on its script's file, so dvc.yaml reads as the pipeline (`expected_code_dep`). An edit re-runs `code`
(seconds: it parses the files, imports none) and then exactly the stages whose digest changed.

Runtime imports by name are not statements: `methods.get_method(name)` loads `clipfinetune/methods/<name>.py`. A
foreach cannot give one run a file of its own method, so stage `code` also writes data/code/methods/<method>.json,
the digest of each method's closure (`method_closure`: its module and what it imports), and stage `run_settings`
copies into data/runs/<run>.json the digests of the methods the run executes (`Method.methods_run`: its own; the
mix, the methods it names): an edited loss re-trains that method's runs (and a mix naming it), no other, and a new
method module re-trains nothing that exists. tests/test_stage_deps.py checks dvc.yaml and the closures.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "clipfinetune"
CODE_DIR = "data/code"
CODE_STAGE = "code"                 # the stage that writes the digests: it depends on the code folders themselves
CODE_FOLDERS = ("clipfinetune", "stages")
# data files a module reads next to itself (Path(__file__).parent / ...)
RESOURCES = {
    "clipfinetune/models/loading.py": ["clipfinetune/models/configs"],
    "clipfinetune/data/prepare/word_regions.py": ["clipfinetune/data/prepare/chair_synonyms.txt"],
    "clipfinetune/data/negatives/degla/llm.py": ["clipfinetune/data/negatives/degla/fewshot"],
    "clipfinetune/eval/box_cls.py": ["clipfinetune/eval/templates"],
}
# folders whose modules are loaded by name at run time, taken whole (with everything their files import) by any stage
# that imports the module on the left (`readers.reader(name)` for a source's reader)
RUNTIME = {"clipfinetune/data/readers/__init__.py": ["clipfinetune/data/readers"]}


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
    if _memo is not None and path in _memo["imports"]:
        return _memo["imports"][path]
    found = {p for f in module_imports(path) for p in _with_parents(f)}
    if _memo is not None:
        _memo["imports"][path] = found
    return found


_memo: dict | None = None          # within `_memoized()`: each file parsed and hashed once for every closure


@contextlib.contextmanager
def _memoized():
    global _memo
    _memo = {"imports": {}, "digest": {}}
    try:
        yield
    finally:
        _memo = None


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
    """The files a method's module loads by import statements (a run's code beyond the train stage's own)."""
    return closure(f"{PACKAGE}/methods/{method}.py")


def stage_scripts() -> list[str]:
    """Every stage script (stages/<name>.py; `_` helpers and the digest stage itself excluded)."""
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "stages").glob("*.py")
                  if not p.name.startswith("_") and p.stem != CODE_STAGE)


def stage_closure(script: str) -> list[str]:
    """The stage script's closure with each runtime folder it loads by name (and its files' closure)."""
    files, folders, done = set(closure(script)), set(), set()
    while True:
        folders |= {d for module, dirs in RUNTIME.items() if module in files for d in dirs}
        if not folders - done:
            break
        folder = min(folders - done)
        done.add(folder)
        for path in sorted((ROOT / folder).rglob("*.py")):
            files |= set(closure(path.relative_to(ROOT)))
    return sorted(files | done)


def digest(rel: str) -> str:
    """md5 of a file, or of a folder's files (each one's path and bytes)."""
    if _memo is not None and rel in _memo["digest"]:
        return _memo["digest"][rel]
    path = ROOT / rel
    files = sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts) \
        if path.is_dir() else [path]
    h = hashlib.md5()
    for f in files:
        h.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    if _memo is not None:
        _memo["digest"][rel] = h.hexdigest()
    return h.hexdigest()


def digests(files) -> dict[str, str]:
    """{file or folder: md5}, what a data/code/*.json file holds (a folder inside another entry counts once)."""
    files = sorted(files)
    folders = [d + "/" for d in files if (ROOT / d).is_dir()]
    return {f: digest(f) for f in files if not any(f.startswith(d) for d in folders)}


def code_files() -> dict[str, dict[str, str]]:
    """data/code's files (relative to it) -> their content: every stage script's digest and every method's."""
    from clipfinetune.registry import MIX, discover

    with _memoized():
        out = {f"stages/{Path(s).stem}.json": digests(stage_closure(s)) for s in stage_scripts()}
        out |= {f"methods/{m}.json": digests(method_closure(m)) for m in (*discover(ROOT / PACKAGE / "methods"), MIX)}
    return out


def _is_code(dep) -> bool:
    return isinstance(dep, str) and dep.startswith(("stages/", f"{PACKAGE}/"))


def stage_script(body: dict) -> str:
    """The script a stage runs: the `stages/<x>.py` of its cmd."""
    (script,) = [w for w in body["cmd"].split() if w.startswith("stages/") and w.endswith(".py")]
    return script


def expected_code_dep(body: dict) -> str | None:
    """The one code dep of a stage body: its script's digest (None: the digest stage, or an always-changed stage,
    which runs on every repro whatever its code)."""
    script = stage_script(body)
    if Path(script).stem == CODE_STAGE or body.get("always_changed"):
        return None
    return f"{CODE_DIR}/stages/{Path(script).stem}.json"


def _bodies(dvc: dict):
    for name, stage in dvc["stages"].items():
        yield name, stage.get("do", stage)


def diff(dvc: dict) -> dict[str, tuple[list[str], list[str]]]:
    """stage -> (code deps dvc.yaml lacks, code deps it lists in excess); stages that agree are left out."""
    out = {}
    for name, body in _bodies(dvc):
        if "cmd" not in body:                               # eval_base: the eval body through a YAML merge key
            continue
        deps = [d for d in body.get("deps", []) if isinstance(d, str)]
        if Path(stage_script(body)).stem == CODE_STAGE:
            missing = sorted(set(CODE_FOLDERS) - set(deps))
            extra = sorted(d for d in deps if _is_code(d) and d not in CODE_FOLDERS)
        else:
            wanted = expected_code_dep(body)
            missing = [wanted] if wanted and wanted not in deps else []
            extra = sorted(d for d in deps if _is_code(d) or (d.startswith(CODE_DIR + "/stages/") and d != wanted))
        if missing or extra:
            out[name] = (missing, extra)
    return out


def write(path: Path = ROOT / "dvc.yaml") -> dict:
    """Rewrite dvc.yaml: each stage body's code files replaced by its digest dep (first), its data deps kept in
    order with their comments."""
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
        missing, extra = changes[name]
        old = body.get("deps", CommentedSeq())
        keep = [i for i, d in enumerate(old) if d not in extra]
        new = CommentedSeq(missing + [old[i] for i in keep])
        for j, i in enumerate(keep, start=len(missing)):         # a data dep keeps its end-of-line comment
            if i in old.ca.items:
                new.ca.items[j] = old.ca.items[i]
        body["deps"] = new
    tmp = path.with_suffix(".yaml.tmp")
    with open(tmp, "w") as f:
        y.dump(dvc, f)
    tmp.replace(path)
    return changes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clipfinetune.project.deps", description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the code files dvc.yaml lists by the digest deps")
    p.add_argument("--show", metavar="STAGE", help="print the files the stage script stages/STAGE.py loads")
    args = p.parse_args(argv)
    if args.show:
        print("\n".join(stage_closure(f"stages/{args.show}.py")))
        return 0
    import yaml

    changes = write() if args.write else diff(yaml.safe_load((ROOT / "dvc.yaml").read_text()))
    for name, (missing, extra) in changes.items():
        print(f"{name}:" + "".join(f"\n  + {d}" for d in missing) + "".join(f"\n  - {d}" for d in extra))
    print(f"dvc.yaml: {len(changes)} stages {'rewritten' if args.write else 'differ'}")
    return 1 if changes and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
