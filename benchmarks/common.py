"""Shared pieces of the benchmarks: paths, the model snapshot, result rows, subprocess helpers."""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "benchmarks" / "_work"
SHARDS = ROOT / "data" / "shards"


def pythonpath(*first: str | os.PathLike) -> str:
    """`first`, then every entry of this process's PYTHONPATH (in order, each once): a child process given it imports
    from the same place as its parent, packages installed with `pip install --target` into folders on PYTHONPATH
    included (a GPU machine without a package index gets its packages that way: benchmarks/README.md)."""
    entries = [str(p) for p in first] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def child_env(**extra: str) -> dict:
    """The environment of a benchmark's child process: this one's, the repository first on PYTHONPATH, then every
    folder the parent's PYTHONPATH names (never dropped), then `extra`."""
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": pythonpath(ROOT), **extra}


@dataclass
class Row:
    figure: str
    ours: float | None
    reference: float | None
    ratio: float | None
    goal: str                     # e.g. ">= 1.0", "<= 1.2", "< 30 s", "info"
    passed: bool | None           # None: no goal (information only)
    unit: str = ""
    details: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def model_snapshot() -> tuple[Path, str]:
    """A private copy of models/base (the DAG may rebuild it while we run); if models/base does not exist
    (pretrain running), a randomly initialised `cft-tiny-vit` exported in the same layout: step times do not
    depend on the weights. Returns (folder, description)."""
    src = ROOT / "models" / "base"
    dst = WORK / "model_base"
    if (src / "open_clip_config.json").is_file() and (src / "open_clip_model.safetensors").is_file():
        tmp = WORK / "model_base.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        return dst, "copy of models/base"
    from clipfinetune.models import export_model, load_model

    export_model(load_model("cft-tiny-vit"), dst)
    return dst, "models/base absent: random-init cft-tiny-vit exported (same architecture and shapes)"


def run(cmd: list[str], *, timeout: float = 900, cwd: Path = ROOT) -> tuple[int, str, float]:
    """Run a command niced (by 19, or $BENCH_NICE when 19 would starve it); returns (returncode, output, wall s)."""
    full = ["nice", "-n", os.environ.get("BENCH_NICE", "19"), *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(full, check=False, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout, time.perf_counter() - t0


def shell(cmd: list[str]) -> str:
    import shlex

    return f"nice -n {os.environ.get('BENCH_NICE', '19')} " + " ".join(shlex.quote(c) for c in cmd)


def python() -> str:
    return sys.executable


def load_params() -> dict:
    import yaml

    return yaml.safe_load((ROOT / "params.yaml").read_text())


def method_run(params: dict, method: str) -> dict:
    """The effective settings (clipfinetune/runs.py `resolve_runs`: method, config, train, precision) of params.yaml's
    run named `method`, else its first run of that method: what train@<that run> trains with."""
    from clipfinetune.runs import resolve_runs

    runs = resolve_runs(params)
    if runs.get(method, {}).get("method") == method:
        return runs[method]
    found = [run for run in runs.values() if run["method"] == method]
    if not found:
        raise ValueError(f"params.yaml runs: no run of method {method!r} (runs: {sorted(runs)})")
    return found[0]
