"""Resolving the DAG: the stages `dvc repro` would run (DVC's own expansion, in a scratch copy) and whether one is up
to date (dvc.lock read as a file)."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from clipfinetune.project.plan.common import _get


# ----------------------------------------------------------------------------------------------- the DAG, by DVC
@dataclass
class DagStage:
    name: str
    script: str
    args: dict
    declared: list[str]
    deps: list[str]                   # data deps (not the code, not params.yaml)
    outs: list[str]
    cmd: str = ""
    every_dep: list[str] = field(default_factory=list)    # code and data, as dvc.lock lists them


def dag_stages(root: Path, params_file: Path | None = None) -> list[DagStage]:
    """The stages `dvc repro` would run for these params, in DVC's topological order, as DVC expands them: dvc.yaml
    resolved against the params file in a scratch copy (no data, no lock), never in the project itself, which a
    running `dvc repro` holds locked when stage plan@repro asks."""
    root = Path(root).resolve()
    params_file = root / "params.yaml" if params_file is None else Path(params_file)
    where = Path(tempfile.mkdtemp(prefix="clipfinetune-plan-"))
    try:
        (where / ".dvc").mkdir()
        (where / ".dvc" / "config").write_text("[core]\n    no_scm = true\n    analytics = false\n")
        shutil.copyfile(root / "dvc.yaml", where / "dvc.yaml")
        shutil.copyfile(params_file, where / "params.yaml")
        return _read_dag(where)
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _read_dag(where: Path) -> list[DagStage]:
    import networkx as nx
    from dvc.repo import Repo

    out = []
    with Repo(str(where)) as repo:
        order = {id(s): f"{n:05d}" for n, s in enumerate(repo.index.stages)}    # dvc.yaml's order
        # dependencies first (DVC's graph points from a stage to the stages it depends on), else dvc.yaml's order
        graph = repo.index.graph.reverse(copy=True)
        for stage in nx.lexicographical_topological_sort(graph, key=lambda s: order.get(id(s), "99999")):
            if not getattr(stage, "cmd", None):
                continue
            words = shlex.split(stage.cmd)
            script = next((w for w in words if w.endswith(".py")), "")
            args = {words[i][2:]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
            declared = [k for p in stage.params for k in (p.params if isinstance(p.params, list) else list(p.params))]
            every = [d.def_path for d in stage.deps if d.def_path != "params.yaml"]
            out.append(DagStage(stage.name, script, args, declared,
                                [d for d in every if not d.startswith(("stages/", "clipfinetune/"))],
                                [o.def_path for o in stage.outs], stage.cmd, every))
    return out


# ------------------------------------------------------------------------------- up to date, from dvc.lock
class LockedStages:
    """"Would `dvc repro` skip this stage?" answered from dvc.lock read as a file against the current params, cmd
    and deps, never through DVC's repository API: inside `dvc repro` / `dvc exp run` stage plan@repro runs while
    DVC holds the project's lock, and DVC has removed data/plan (plan@repro's own output) by then. A stage is up to
    date when its lock entry has the same cmd, the same declared params with the same values, the same deps, each
    dep and out holding the recorded md5 (a folder: DVC's `.dir` md5 of its file list), and every stage it depends
    on is up to date too; plan@repro's own output counts as unchanged (the same file whenever the plan passes).
    Anything unreadable or in an older lock format answers "not up to date", which only makes the plan ask more."""

    DEFAULT_IGNORED = (".git", ".hg", ".dvc")       # DVC's own ignore list, before .dvcignore

    def __init__(self, root: Path, params: dict, stages: list[DagStage]):
        import yaml

        self.root, self.params = Path(root), params
        self.stages = {s.name: s for s in stages}
        self.producer = {o: s.name for s in stages for o in s.outs}
        try:
            self.lock = (yaml.safe_load((self.root / "dvc.lock").read_text()) or {}).get("stages") or {}
        except (OSError, yaml.YAMLError):
            self.lock = {}
        ignore = self.root / ".dvcignore"
        extra = [line.strip().strip("/") for line in ignore.read_text().splitlines()] if ignore.is_file() else []
        self.ignored = set(self.DEFAULT_IGNORED) | {p for p in extra if p and not p.startswith("#")}
        self.known: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        if name not in self.known:
            self.known[name] = False                   # a cycle (none in a DVC graph) answers "not up to date"
            self.known[name] = self._check(name)
        return self.known[name]

    def _check(self, name: str) -> bool:
        entry, stage = self.lock.get(name), self.stages.get(name)
        if not entry or stage is None or entry.get("cmd") != stage.cmd:
            return False
        locked = {k: v for by_file in (entry.get("params") or {}).values() for k, v in (by_file or {}).items()}
        missing = object()
        if set(locked) != set(stage.declared) or any(_get(self.params, k, missing) != v for k, v in locked.items()):
            return False
        deps = {d["path"]: d for d in entry.get("deps") or []}
        if set(deps) != set(stage.every_dep):
            return False
        for path, recorded in deps.items():
            producers = self._producers_of(path)
            if producers and all(self.stages[p].script == "stages/plan.py" for p in producers):
                continue                               # data/plan: the same file whenever the plan passes
            if not all(self(p) for p in producers) or not self._holds(path, recorded):
                return False
        return all(self._holds(o["path"], o) for o in entry.get("outs") or [])

    def _producers_of(self, path: str) -> set[str]:
        """The stages writing `path`, a file or folder inside it, or a folder holding it."""
        p = Path(path)
        return {n for o, n in self.producer.items() if p == Path(o) or Path(o) in p.parents or p in Path(o).parents}

    def _holds(self, path: str, recorded: dict) -> bool:
        if recorded.get("hash") != "md5" or "md5" not in recorded:
            return False                               # DVC 2's md5-dos2unix or another algorithm: not compared
        full = self.root / path
        if not full.exists():
            return False
        if full.is_dir():
            return str(recorded["md5"]).endswith(".dir") and self._dir_md5(full) == recorded["md5"]
        if "size" in recorded and full.stat().st_size != recorded["size"]:
            return False
        return _file_md5(full) == recorded["md5"]

    def _dir_md5(self, folder: Path) -> str:
        """DVC's md5 of a folder: md5 of the JSON list of {md5, relpath} of its files, sorted by relpath, + ".dir"."""
        entries = []
        for top, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in self.ignored]
            for f in files:
                if f not in self.ignored:
                    full = Path(top) / f
                    entries.append({"md5": _file_md5(full), "relpath": full.relative_to(folder).as_posix()})
        entries.sort(key=lambda e: e["relpath"])
        return hashlib.md5(json.dumps(entries, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def _file_md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_type(root: Path) -> str:
    """`cache.type` of the project's DVC config (config.local over config): links hold outputs once, copy twice."""
    import configparser

    kind = "reflink,copy (DVC's default)"
    for name in ("config", "config.local"):
        cp = configparser.ConfigParser()
        try:
            cp.read(root / ".dvc" / name)
        except configparser.Error:
            continue
        if cp.has_option("cache", "type"):
            kind = cp.get("cache", "type")
    return kind
