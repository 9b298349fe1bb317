"""Fault-injection suite: shared tiny project (issue 16).

ONE session fixture (`tiny_project`) copies the repo's code (stages/, clipfinetune/, dvc.yaml, the committed
params.yaml) into a temporary folder, makes it a DVC repo (`dvc init --no-scm`), shrinks params.yaml to a tiny
sample world and runs every data stage plus `pretrain` there for real, as `python stages/<name>.py --stage <name>`
subprocesses. Its outputs are the references the fault tests compare against. A test copies the project (`clone`) and
mutates only its copy; stages run either in a subprocess (kills, resumes) or in-process (`run_inprocess`, the
stage's own `main()` with `_common.ROOT` pointed at the copy) when the test only needs its error or its meta.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.project import TINY, committed, write_params

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# the tests' tiny profile (tests/fixtures/project.py), and what the faults exercise beyond it: a training run with a
# checkpoint after every step over two epochs (kills and resumes between them), several shards per source
FAULTS = {"train": {"epochs": 2, "checkpoint_every": 1}, "shards": {"maxcount": 4}}
# stage -> what it writes (relative to the project root); meta keys that measure the run, not its result
OUTPUTS = {
    "sample": ["data/sample"],
    "word_regions": ["data/prepared/word_regions.parquet", "data/prepared/word_regions.meta.json"],
    "sentences": ["data/prepared/sentences.parquet", "data/prepared/sentences.meta.json"],
    "segments": ["data/prepared/segments.parquet", "data/prepared/segments.meta.json"],
    "negatives": ["data/prepared/negatives.parquet", "data/prepared/negatives.meta.json",
                  "metrics/negatives.json"],
    "lism": ["data/prepared/local_pairs.parquet", "data/prepared/local_pairs.meta.json",
             "data/evalsets/global_local", "metrics/lism.json"],
    "shards": ["data/shards"],
}
RUN_STATISTICS = {"data/prepared/negatives.meta.json": {"seconds", "requests_asked", "answers_from_cache",
                                                         "cache_corrupt_lines"}}
CODE = ["stages", "clipfinetune", "dvc.yaml", "params.yaml", ".dvc", "data/plan"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
       "DVC_NO_ANALYTICS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
ENV.pop("DVC_STAGE", None)


def _ignore(_dir, names):
    return [n for n in names if n in ("__pycache__", "tmp") or n.endswith(".pyc")]


# the stages dvc.yaml runs once per list entry (`foreach: ${<stage>.sources}`, the sample world's
# `${sample.build}`): <stage>@<entry>
PREPARING = {"word_regions": "coco", "negatives": "coco", "sentences": "docci", "segments": "docci", "lism": "docci",
             "sample": "world"}


def dvc_name(stage: str) -> str:
    return f"{stage}@{PREPARING[stage]}" if stage in PREPARING else stage


def stage_cmd(stage: str) -> list[str]:
    if stage.startswith("train@"):
        run = stage.split("@", 1)[1]
        return [PY, "stages/train.py", "--run", run, "--method", run, "--stage", stage]
    if stage.startswith("eval@"):
        return [PY, "stages/eval.py", "--model", stage.split("@", 1)[1], "--stage", stage]
    if stage == "eval_base":
        return [PY, "stages/eval.py", "--model", "base", "--stage", stage]
    return [PY, f"stages/{stage}.py", "--stage", dvc_name(stage)]


def resolve_run_settings(root: Path, stage: str) -> None:
    """Before a train@<run>: its settings file data/runs/<run>.json from the project's params.yaml, as DVC runs stage
    `run_settings` first."""
    if stage.startswith("train@"):
        run_stage(root, "run_settings")


def start_stage(root: Path, stage: str) -> subprocess.Popen:
    resolve_run_settings(root, stage)
    return subprocess.Popen(stage_cmd(stage), cwd=root, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


# a guard against a hung stage, not a speed test: the tiny profile's stages take seconds on an idle machine and several
# minutes on a shared 2-core one
def run_stage(root: Path, stage: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    resolve_run_settings(root, stage)
    proc = subprocess.run(stage_cmd(stage), cwd=root, env=ENV, capture_output=True, text=True, timeout=timeout,
                          check=False)                     # a failure is reported below, with the stage's output
    if check and proc.returncode != 0:
        raise AssertionError(f"stage {stage} failed in {root}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


# a process that keeps one core busy and ends by itself after `seconds` (so nothing outlives a killed test run)
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_cores(seconds: float = 300.0):
    """The machine kept busy for the block: one spinning process per core (at normal priority), each bounded to
    `seconds`, and all of them killed (by pid) when the block ends."""
    spinners = [subprocess.Popen([PY, "-c", SPIN, str(seconds)]) for _ in range(os.cpu_count() or 1)]
    try:
        yield len(spinners)
    finally:
        for p in spinners:
            kill(p)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the stage (our own child, by pid) and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)


class Project:
    def __init__(self, root: Path):
        self.root = root

    def __truediv__(self, rel) -> Path:
        return self.root / rel

    def params(self) -> dict:
        return yaml.safe_load((self.root / "params.yaml").read_text())

    def set_params(self, **groups) -> None:
        p = self.params()
        for group, values in groups.items():
            p[group].update(values)
        (self.root / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))

    def clone(self, dst: Path, data: list[str] = ()) -> Project:
        """A copy of the code, the DVC metadata and the listed data paths (everything a test mutates)."""
        dst.mkdir(parents=True, exist_ok=True)
        for rel in [*CODE, *data]:
            src = self.root / rel
            if src.is_dir():
                shutil.copytree(src, dst / rel, ignore=_ignore, symlinks=True)
            elif src.exists():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst / rel)
        return Project(dst)

    def snapshot(self, stage: str) -> dict[str, bytes]:
        """Every file a stage wrote, by relative path; run statistics removed from its meta JSON."""
        out = {}
        for rel in OUTPUTS[stage]:
            p = self.root / rel
            files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
            for f in files:
                key = f.relative_to(self.root).as_posix()
                data = f.read_bytes()
                if key in RUN_STATISTICS:
                    meta = json.loads(data)
                    for k in RUN_STATISTICS[key]:
                        meta.pop(k, None)
                    data = json.dumps(meta, sort_keys=True).encode()
                out[key] = data
        return out

    def meta(self, rel: str) -> dict:
        return json.loads((self.root / rel).read_text())


@pytest.fixture(scope="session")
def tiny_project(tmp_path_factory) -> Project:
    root = tmp_path_factory.mktemp("tiny_project")
    for rel in ("stages", "clipfinetune", "dvc.yaml"):
        src = REPO / rel
        if src.is_dir():
            shutil.copytree(src, root / rel, ignore=_ignore)
        else:
            shutil.copy2(src, root / rel)
    (root / "params.yaml").write_text(committed("params.yaml"))     # not the workspace's (a user's -S edits)
    (root / "data" / "plan").mkdir(parents=True)                      # committed (.gitkeep): every stage's dep
    (root / "data" / "plan" / ".gitkeep").touch()
    subprocess.run([PY, "-m", "dvc", "init", "--no-scm", "-q"], cwd=root, env=ENV, check=True)
    proj = Project(root)
    write_params(root, TINY)
    write_params(root, FAULTS)
    proj.durations = {}

    def timed(stages):       # independent stages run side by side (one thread each)
        t0 = time.perf_counter()
        procs = {s: start_stage(root, s) for s in stages}
        for s, p in procs.items():
            out, _ = p.communicate(timeout=900)
            if p.returncode != 0:
                raise AssertionError(f"building the tiny project: stage {s} failed:\n{out[-5000:]}")
            proj.durations[s] = time.perf_counter() - t0

    timed(["sample"])
    timed(["word_regions", "sentences", "segments"])
    timed(["negatives", "pretrain"])
    timed(["lism"])
    timed(["shards"])
    return proj


# ------------------------------------------------------------------------------------------ in-process stages
INPROCESS_STAGES = ("sample", "word_regions", "sentences", "segments", "negatives", "pretrain", "lism", "shards",
                    "run_settings", "train")


@pytest.fixture()
def inprocess(monkeypatch):
    """run(project, stage, *argv): the stage's own main() in this process, against the project copy."""
    monkeypatch.delenv("DVC_STAGE", raising=False)
    from stages import _common

    # import every stage before anything is patched: `from stages._common import ROOT` binds at import time
    modules = {name: importlib.import_module(f"stages.{name}") for name in INPROCESS_STAGES}

    def run(proj: Project, stage: str, *argv: str):
        name = stage.split("@")[0]
        if name == "train":                 # its settings file first, as DVC runs stage run_settings before it
            run(proj, "run_settings")
        module = modules[name]
        for mod in (_common, module):
            # ROOT and every absolute path derived from it at import time (e.g. sample's OUT) -> the copy:
            # an in-process stage must never write into the repository itself
            for attr, value in list(vars(mod).items()):
                if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(REPO):
                    monkeypatch.setattr(mod, attr, proj.root / value.relative_to(REPO))
            leftover = [a for a, v in vars(mod).items() if isinstance(v, (str, Path)) and str(v).startswith(str(REPO))
                        and a not in ("__file__", "__cached__")]
            assert not leftover, f"{mod.__name__}: {leftover} still point into {REPO}"
        monkeypatch.chdir(proj.root)
        monkeypatch.setattr(sys, "argv", [f"stages/{name}.py", *argv, "--stage", dvc_name(stage)])
        return module.main()

    return run


def corrupt_jpeg(path: Path) -> None:
    """Keep the JPEG header (it still opens) but cut the entropy-coded data: decoding fails."""
    data = path.read_bytes()
    path.write_bytes(data[: max(200, len(data) // 3)])
