"""`clipfinetune plan`: what `dvc repro` would run in the applied configuration, on N GPUs, and what would stop it.

    clipfinetune plan [--gpus N] [--nodes M] [--params params.yaml] [--gpu-kind NAME] [--json] [--leakage]
    python -m clipfinetune.plan ...

It reads the params file, asks DVC for the stages of its DAG (foreach bodies and `[]` sources exactly as `dvc repro`
expands them) and resolves, per stage: device, ranks (clipfinetune.compute's rules, the ones the stages' launcher
applies), per-rank batch, steps per epoch, units seen and repeated per epoch (exact from the shards' index through
`clipfinetune.data.loader.epoch_coverage` when the shards exist; before, estimated from the sources' record counts
and marked so), input and output sizes, LLM requests, and a wall time from measured throughput
(benchmarks/calibration.json, each figure with its source), marked measured, scaled (from what, by what rule: a
per-rank batch under the measured one interpolated between the card's latency floor and the batch-128 rate, a rank
fed at most at its loader workers' rate) or unknown. The total is printed as "at least", with the share of stages it
covers, and GPU-hours; a paper's own stated cost stands beside its run; a latency-bound per-rank batch (under ~32)
is named with the better layout (the runs side by side on a share of the GPUs each).

It exits 1 BEFORE any work, naming the param to change and values that would work, when the configuration would stop
or silently degrade a run: a batch that does not split over the ranks, a stage declaring params it will not read
(`compute`, the hardware) or that the params lack, a run reading a table that no stage of the configuration writes
(e.g. local pairs with `lism.sources: []`), a GPU shared by a vLLM server and the ranks, sample-world sets
scored on a real model, epoch coverage under 100%, and every missing input (`clipfinetune.validate.check`). Warnings
(idle GPUs, stages whose table no run reads, several nodes) do not fail it.

`make_plan(params, root, ...)` is the library entry (a dict in, a dict out); only `main` reads the params file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from clipfinetune import compute as rules
from clipfinetune.runs import batch_param, resolve_runs

CALIBRATION = Path("benchmarks") / "calibration.json"      # relative to the project root
LONG_READERS = {"docci", "dci", "urban1k", "sharegpt4v"}
STAGE_SOURCE_KIND = {"word_regions": "short", "negatives": "short", "sentences": "long", "segments": "long",
                     "lism": "long"}
# what reads a data stage's table besides the training runs: lism reads sentences and segments
DOWNSTREAM = {"sentences": ["lism"], "segments": ["lism"]}
LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1", ""}
ITEM_SCRIPTS = {"stages/segments.py", "stages/lism.py", "stages/eval.py"}
MINOR = {"sample", "method_code", "benchmarks", "report"}     # seconds to minutes at any size: left out of the summary


@dataclass
class Refusal:
    stage: str            # "" = the configuration as a whole
    param: str            # the key to change
    message: str
    fixes: list[str] = field(default_factory=list)

    def __str__(self):
        where = f"[{self.stage}] " if self.stage else ""
        fixes = f" Values that work: {'; '.join(self.fixes)}" if self.fixes else ""
        return f"{where}{self.param}: {self.message}.{fixes}"


@dataclass
class StageRow:
    stage: str
    kind: str                         # data | items | training | export
    device: str = "cpu"
    ranks: int = 1
    gpus: list[str] = field(default_factory=list)
    global_batch: int | None = None
    rank_batch: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    units: int | None = None          # per epoch
    seen: int | None = None
    repeated: int | None = None
    coverage: str = ""                # exact | estimated | unknown | ""
    items: int | None = None          # what an item or data stage processes (images, captions)
    items_what: str = ""
    inputs_bytes: int | None = None
    outputs_bytes: int | None = None
    outputs_note: str = ""
    llm_requests: int | None = None
    seconds: float | None = None
    basis: str = "unknown"            # measured | scaled | unknown (the time's)
    time_source: str = "unknown"      # from what, by what rule
    gpu_seconds: float | None = None  # seconds x the GPUs it holds
    paper: str = ""                   # the paper's own stated cost of such a run, where it gives one
    method: str = ""                  # a training stage's method (its step rate)
    latency_bound: bool = False       # per-rank batch under ~32: more GPUs do not make its steps faster
    notes: list[str] = field(default_factory=list)


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


# -------------------------------------------------------------------------------------- the loader's coverage
def epoch_coverage(shards_dir: Path, method, *, global_batch: int, world_size: int, num_workers: int,
                   epoch_unit: str, epoch_samples: int, accum_steps: int) -> dict | None:
    """DEVELOPERS.md interface 2 (`clipfinetune.data.loader.epoch_coverage`, exact from the shards' index); None
    where the loader does not offer it."""
    try:
        from clipfinetune.data.loader import epoch_coverage as coverage
    except ImportError:
        return None
    return coverage(shards_dir, "train", method, global_batch=global_batch, world_size=world_size,
                    num_workers=num_workers, epoch_unit=epoch_unit, epoch_samples=epoch_samples,
                    accum_steps=accum_steps)


# --------------------------------------------------------------------------------------------- measured rates
def load_calibration(root: Path) -> list[dict]:
    path = Path(root) / CALIBRATION
    if not path.is_file():
        return []
    return json.loads(path.read_text()).get("figures", [])


LARGE_BATCH = 128          # a train_step figure without `batch` was measured at 128 per rank (the step tables)
LATENCY_BOUND = 32         # below this per-rank batch a step costs about as much as a tiny one (measured: 2 and 16)


def find_figure(figures: list[dict], device: str, what: str, arch: str = "", method: str = "",
                batch: int | None = None) -> dict | None:
    """The measured figure of `what` (train_step, segments, word_regions, ...) on this device kind (a figure's device
    name contained in it, case-insensitive: "H200" in "NVIDIA H200"), for this architecture and method (a figure
    naming none applies to all), and for a train_step at this per-rank batch (None: the large-batch rate)."""
    device = device.lower()
    for f in figures:
        if f["what"] == what and f.get("device") and f["device"].lower() in device \
                and f.get("arch", "") in ("", arch) and f.get("method", "") in ("", method) \
                and (batch is None or f.get("batch", LARGE_BATCH) == batch) \
                and (batch is not None or what != "train_step" or f.get("batch", LARGE_BATCH) >= LARGE_BATCH):
            return f
    return None


def _source(f: dict) -> str:
    return f"{f['value']:g} {f['unit']} on {f['device']} ({f['source']})"


@dataclass
class StepTime:
    seconds: float             # one optimizer step's micro-batch on one rank
    basis: str                 # measured | scaled
    how: str                   # from what, by what rule


def step_time(figures: list[dict], device: str, arch: str, method: str, batch: int) -> StepTime | None:
    """Seconds of one training step at `batch` per rank, from the method's large-batch rate and the latency floor
    (train_step figures at small batches, any method): at or above the large batch the per-sample rate holds
    (linear); below it the step time is interpolated between the measured batches, and under the smallest one it is
    that one's (a step cannot get cheaper than the card's latency). None when the method's rate was not measured."""
    top = find_figure(figures, device, "train_step", arch, method)
    if top is None:
        return None
    big = int(top.get("batch", LARGE_BATCH))
    points = {big: big / top["value"]}
    floor = [f for f in figures if f["what"] == "train_step" and f.get("device") and f["device"].lower()
             in device.lower() and f.get("arch", "") in ("", arch) and f.get("method", "") in ("", method)
             and f.get("batch", LARGE_BATCH) < big]
    for f in floor:
        points.setdefault(int(f["batch"]), int(f["batch"]) / f["value"])
    if batch == big:
        return StepTime(points[batch], "measured", _source(top))
    same = [f for f in floor if f["batch"] == batch]
    if same:                           # measured at this batch: this method's own step, or the card's latency floor
        own = any(f.get("method", "") == method for f in same)
        return StepTime(points[batch], "measured" if own else "scaled",
                        _source(same[0]) + ("" if own else f"; the latency floor at batch {batch}, taken for {method}"))
    if batch > big or len(points) == 1:
        rule = "x batch / " + str(big) + (" (linear: no smaller batch measured, a lower bound below ~32 per GPU)"
                                           if batch < big else " (linear above the measured batch)")
        return StepTime(batch * points[big] / big, "scaled", f"{_source(top)}; step time {rule}")
    sizes = sorted(points)
    if batch < sizes[0]:
        t = points[sizes[0]]
    else:
        lo = max(b for b in sizes if b < batch)
        hi = min(b for b in sizes if b > batch)
        t = points[lo] + (points[hi] - points[lo]) * (batch - lo) / (hi - lo)
    measured = ", ".join(f"batch {b}: {points[b] * 1000:.1f} ms" for b in sizes)
    return StepTime(t, "scaled", f"step time interpolated between the measured batches ({measured}; {_source(top)})")


# ------------------------------------------------------------------------------------------------ helpers
def _get(params: dict, key: str, default=None):
    node = params
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _has(params: dict, key: str) -> bool:
    sentinel = object()
    return _get(params, key, sentinel) is not sentinel


class _Sizes:
    """Bytes of files and folders (walked once each)."""

    def __init__(self, root: Path):
        self.root, self.known = Path(root), {}

    def __call__(self, rel: str) -> int | None:
        path = Path(rel) if Path(rel).is_absolute() else self.root / rel
        if rel not in self.known:
            self.known[rel] = _walk(path) if path.exists() else None
        return self.known[rel]


def _walk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total, stack = 0, [path]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=True):
                    stack.append(e.path)
                elif e.is_file(follow_symlinks=True):
                    total += e.stat().st_size
    return total


class _Records:
    """Each source's records, read once (through its reader, as the stages read it)."""

    def __init__(self, params: dict, root: Path):
        self.params, self.root, self.known = params, Path(root), {}

    def __call__(self, name: str) -> list | None:
        if name not in self.known:
            import contextlib

            from clipfinetune.data.readers import read_source

            spec = (_get(self.params, "sources") or {}).get(name)
            try:
                with contextlib.chdir(self.root):
                    self.known[name] = read_source(name, spec) if spec else None
            except Exception:  # noqa: BLE001  a missing or bad file is validate's refusal, not a crash of the plan
                self.known[name] = None
        return self.known[name]


def _kind_of_source(params: dict, name: str) -> str:
    reader = (_get(params, f"sources.{name}") or {}).get("reader", "")
    return "long" if reader in LONG_READERS else "short"


def _method(run: dict):
    """The run's method as configured (what the planner needs to know about it, it asks the method's hooks:
    `prepared_tables`, `caption_kinds`, `units_table`, `epoch_unit`); None if it does not construct, which the
    train stage would stop on too (`resolve_runs` refuses unknown methods and keys first)."""
    from clipfinetune.methods import get_method

    try:
        return get_method(run["method"])(**run["config"])
    except Exception:  # noqa: BLE001  the run's own error is the train stage's
        return None


def _tables_needed(run: dict) -> list[tuple[str, str]]:
    method = _method(run)
    return method.prepared_tables() if method is not None else []


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _fmt_int(n) -> str:
    return "-" if n is None else f"{n:,}"


# ------------------------------------------------------------------------------------------------- the plan
@dataclass
class Hardware:
    gpus: int                 # per node
    nodes: int
    gpu_kind: str             # e.g. "NVIDIA H200"; "cpu" without GPUs


def make_plan(params: dict, root, hardware: Hardware, *, stages: list[DagStage] | None = None,
              leakage: bool = False, timeout: float = 5.0) -> dict:
    """The plan as a dict: hardware, stages (StageRow as dicts, DVC's order), refusals, warnings, total_seconds, ok.
    `stages`: DVC's view of the DAG (`dag_stages`). Whether a negatives stage would run (and so needs its LLM) comes
    from the project's dvc.lock (`LockedStages`)."""
    root = Path(root)
    stages = dag_stages(root) if stages is None else stages
    up_to_date = LockedStages(root, params, stages)
    negatives = _producing(stages, "negatives")
    asks_llm = bool(negatives) and not all(up_to_date(n) for n in negatives)
    refusals: list[Refusal] = []
    warnings: list[str] = []
    sizes, records = _Sizes(root), _Records(params, root)
    figures = load_calibration(root)

    # compute: the hardware the ranks use
    try:
        compute = rules.settings(_get(params, "compute"))
    except rules.ComputeError as e:
        refusals.append(Refusal("", e.param, str(e), e.fixes))
        compute = rules.settings(None)
    visible = [str(i) for i in range(hardware.gpus)]
    cuda = rules.uses_cuda(compute, len(visible))
    if compute["device"] == "cuda" and not visible:
        refusals.append(Refusal("", "compute.device", "cuda, but no GPU is visible (--gpus 0)",
                                ["compute.device: auto", "compute.device: cpu"]))
    try:
        gpus = rules.rank_gpus(compute, visible) if cuda else []
        most = rules.item_ranks(compute, len(gpus), cuda)
    except rules.ComputeError as e:
        fixes = e.fixes
        if e.param == "compute.llm_gpus":           # one card for the server and the ranks: not at the same time
            neg = ", ".join(_producing(stages, "negatives")) or "negatives@<source>"
            fixes = ["negatives.backend: offline (vLLM inside the stage: the card is free when it ends)",
                     f"or `dvc repro {neg}` first with the server, stop it, then compute.llm_gpus: 0"]
        refusals.append(Refusal("", e.param, str(e), fixes))
        gpus, most = [], 1
    device = "cuda" if cuda else "cpu"
    kind = hardware.gpu_kind if cuda else "cpu"

    runs = {}
    try:
        runs = resolve_runs(params)
    except Exception as e:  # noqa: BLE001  an unknown method or key: the train stage would stop on it
        refusals.append(Refusal("", "runs", f"the runs do not resolve: {e}"))

    refusals += _declared_params(stages, params)
    refusals += _tables_written(stages, params, runs)
    warnings += _tables_unread(stages, params, runs)
    refusals += _sample_sets_on_real_model(params)
    r, w = _llm_beside_ranks(stages, params, compute, hardware, asks_llm)
    refusals += r
    warnings += w
    refusals += _missing_inputs(params, root, stages, leakage, timeout, warnings, asks_llm)

    rows = []
    shards_dir = root / "data" / "shards"
    for st in stages:
        name = st.name
        inputs = [sizes(d) for d in st.deps]
        row = StageRow(name, "data", inputs_bytes=sum(s for s in inputs if s) if any(inputs) else None)
        existing = [sizes(o) for o in st.outs]
        if any(s is not None for s in existing):
            row.outputs_bytes, row.outputs_note = sum(s or 0 for s in existing), "as built"
        if st.script == "stages/train.py":
            _training_row(row, st, params, runs, compute, gpus, most, hardware, device, kind, figures, refusals,
                          warnings, records, shards_dir, sizes, root)
        elif st.script == "stages/pretrain.py":
            _pretrain_row(row, params, compute, gpus, most, hardware, device, kind, figures, refusals, warnings,
                          records)
        elif st.script in ITEM_SCRIPTS:
            _item_row(row, st, params, gpus, most, hardware, device, kind, figures, records)
        else:
            _data_row(row, st, params, figures, records, sizes)
        rows.append(row)

    warnings[:] = _merge_same(warnings)
    if hardware.nodes > 1:
        warnings.append(f"{hardware.nodes} nodes: `dvc repro` starts ranks on this node only; run each model stage "
                        "under torchrun on every node, then `dvc commit -f <stage>` (docs/scale.md, Several nodes)")
    if cuda:
        warnings.append("dvc queue start -j N on this host: the GPU stages of concurrent experiments take their "
                        "cards one at a time (a lock per GPU), only the data stages overlap; -j 1 is as fast for "
                        "GPU-bound work")
    warnings += _latency_advice(rows, figures, kind, str(_get(params, "model.name")), gpus, hardware.nodes)
    for r in rows:
        if r.seconds is not None:
            r.gpu_seconds = r.seconds * len(r.gpus) * hardware.nodes if r.device == "cuda" and r.gpus else 0.0
    counted = [r for r in rows if r.kind != "export" and r.stage.split("@", 1)[0] not in MINOR]
    known = [r.seconds for r in counted if r.seconds is not None]
    sized = [r.outputs_bytes for r in rows if r.outputs_bytes is not None]
    disk = {"outputs_bytes": sum(sized) if sized else None, "stages_unsized": len(rows) - len(sized),
            "cache_type": _cache_type(root)}
    return {"disk": disk, "hardware": {**asdict(hardware), "device": device, "rank_gpus": gpus, "compute": compute},
            "stages": [asdict(r) for r in rows], "refusals": [asdict(r) for r in refusals], "warnings": warnings,
            "total_seconds": sum(known) if known else None,      # at least: the stages with a time only
            "timed_stages": len(known), "counted_stages": len(counted),
            "gpu_hours": sum(r.gpu_seconds or 0 for r in counted) / 3600 if known else None,
            "unknown_time": _grouped([r.stage for r in rows if r.seconds is None and r.kind != "export"
                                      and r.stage not in MINOR]),
            "ok": not refusals}


def _latency_advice(rows, figures, kind, arch, gpus, nodes) -> list[str]:
    """Training stages whose per-rank batch leaves the GPUs latency-bound (under ~32: a step costs about what a
    tiny one does), with the better layout: the runs side by side on a share of the GPUs each, instead of one
    after another on all of them."""
    bound = [r for r in rows if r.latency_bound and r.ranks > 1]
    if not bound:
        return []
    names = ", ".join(r.stage for r in bound)
    floor = sorted((f["batch"], f["batch"] / f["value"] * 1000) for f in figures if f["what"] == "train_step"
                   and f.get("device") and f["device"].lower() in kind.lower() and f.get("batch", LARGE_BATCH) <
                   LATENCY_BOUND and f.get("arch", "") in ("", arch))
    measured = f" ({', '.join(f'batch {b}: {ms:.1f} ms' for b, ms in floor)} measured on {kind})" if floor else ""
    text = (f"{names}: {', '.join(sorted({str(r.rank_batch) for r in bound}))} per GPU is latency-bound: a step "
            f"costs about as much as at the smallest batch{measured}, so {len(gpus) * nodes} GPUs train a run little "
            f"faster than one")
    share = len(gpus) // len(bound) if len(bound) > 1 else 1
    if len(bound) > 1 and share >= 1:
        now = [r.seconds for r in bound]
        side = []
        for r in bound:
            k = next((k for k in range(share, 0, -1) if r.global_batch % (k * nodes) == 0), 1)
            step = step_time(figures, kind, arch, r.method, r.global_batch // (k * nodes))
            side.append(None if step is None or r.seconds is None else
                        r.epochs * r.steps_per_epoch * step.seconds)
        timing = (f": about {_fmt_seconds(max(side))} for all instead of {_fmt_seconds(sum(now))}"
                  if None not in side and None not in now else "")
        text += (f". Better: the {len(bound)} runs side by side on {share} GPU(s) each (compute.train_nproc: "
                 f"{share}, each run's experiment given its own {share} cards with CUDA_VISIBLE_DEVICES; the GPU "
                 f"locks keep concurrent stages off each other's cards){timing}")
    else:
        text += (". Better: compute.train_nproc: 1 and the other GPUs for other experiments side by side "
                 "(`dvc queue start -j N`, the GPU locks keep them apart)")
    return [text]


def _grouped(names: list[str]) -> list[str]:
    """Stage names with foreach bodies counted: ["train@* (12)", "shards", ...]."""
    counts: dict[str, int] = {}
    for n in names:
        base = n.split("@", 1)[0] + "@*" if "@" in n else n
        counts[base] = counts.get(base, 0) + 1
    return [f"{b} ({c})" if c > 1 else (b if not b.endswith("@*") else next(n for n in names if n.startswith(b[:-1])))
            for b, c in counts.items()]


def _merge_same(warnings: list[str]) -> list[str]:
    """"train@a: 4 of 7 GPUs ..." and "train@b: 4 of 7 GPUs ..." (the same text after the stage) -> one line naming
    both stages."""
    out: dict[str, list[str]] = {}
    for w in warnings:
        stage, sep, rest = w.partition(": ")
        if sep and "@" in stage and " " not in stage:
            out.setdefault(rest, []).append(stage)
        else:
            out.setdefault(w, [])
    return [f"{', '.join(stages)}: {text}" if stages else text for text, stages in out.items()]


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


# ---------------------------------------------------------------------------------------------- stage rows
def _training_ranks(row, global_batch, accum, param, compute, gpus, most, hardware, device, refusals, warnings):
    try:
        k = rules.training_ranks(compute, global_batch, most, hardware.nodes, accum, param)
    except rules.ComputeError as e:
        refusals.append(Refusal(row.stage, e.param, str(e), e.fixes))
        return False
    row.device, row.ranks, row.gpus = device, k * hardware.nodes, gpus[:k]
    row.global_batch, row.rank_batch = global_batch, global_batch // (k * hardware.nodes)
    if gpus and k < len(gpus):
        fixes = [f"{param}: {b}" for b in rules.batch_fixes(global_batch, len(gpus) * hardware.nodes, accum)]
        warnings.append(f"{row.stage}: {k} of {len(gpus)} GPUs ({param} {global_batch} splits evenly over no more): "
                        f"GPU(s) {','.join(gpus[k:])} idle; to use all {len(gpus)}: {' or '.join(fixes)}")
    return True


def _training_row(row, st, params, runs, compute, gpus, most, hardware, device, kind, figures, refusals, warnings,
                  records, shards_dir, sizes, root):
    row.kind = "training"
    run_name = st.args.get("run", st.name.split("@", 1)[-1])
    run = runs.get(run_name)
    if run is None:
        return
    train, method = run["train"], run["method"]
    row.method = method
    global_batch, accum = int(train["batch_size"]), int(train.get("accum_steps", 1))
    row.epochs = int(train["epochs"])
    if not _training_ranks(row, global_batch, accum, batch_param(params, method), compute, gpus, most, hardware,
                           device, refusals, warnings):
        return
    coverage = None
    if (shards_dir / "index.json").is_file():
        try:
            from clipfinetune.methods import get_method

            coverage = epoch_coverage(shards_dir, get_method(method)(**run["config"]), global_batch=global_batch,
                                      world_size=row.ranks, num_workers=int(train.get("workers", 0)),
                                      epoch_unit=train.get("epoch_unit", "image"),
                                      epoch_samples=int(train.get("epoch_samples", 0) or 0), accum_steps=accum)
        except Exception as e:  # noqa: BLE001  shards of another configuration: the estimate below, said so
            row.notes.append(f"epoch_coverage failed on data/shards ({e}): estimated")
    if coverage is not None:
        row.units, row.seen, row.repeated = coverage["units"], coverage["seen"], coverage["repeated"]
        row.steps_per_epoch, row.coverage = coverage["steps_per_epoch"], "exact"
        if row.seen < row.units or row.repeated:
            refusals.append(Refusal(st.name, "shards.maxcount",
                                    f"an epoch sees {row.seen:,} of {row.units:,} units and repeats {row.repeated:,} "
                                    f"at {row.ranks} ranks x {train.get('workers', 0)} workers",
                                    ["a smaller shards.maxcount (more shards per reader)", "fewer train.workers"]))
    else:
        units = _estimated_units(params, run, records, root)
        if units is not None:
            row.units, row.seen, row.repeated, row.coverage = units, units, 0, "estimated"
            row.steps_per_epoch = math.ceil(units / global_batch)
        else:
            row.coverage = "unknown"
            row.notes.append("units unknown until its sources' records can be read (`dvc repro shards`, then plan "
                             "again: the loader's exact count)")
    if (sizes("models/base") or 0) and row.outputs_bytes is None:
        row.outputs_bytes, row.outputs_note = sizes("models/base"), "estimated (models/base's size)"
    arch = str(_get(params, "model.name"))
    _training_time(row, figures, kind, arch, method, accum, int(train.get("workers", 0) or 0))
    for f in figures:                  # the paper's own cost of a run (any card: the one the authors had)
        if f["what"] == "paper_run" and f.get("method") == method and f.get("arch", "") in ("", arch):
            row.paper = f"{f['value']:g} {f['unit']} per {f['per']} on one {f['device']} ({f['source']})"
            break


def _training_time(row, figures, kind, arch, method, accum, workers) -> None:
    """A training stage's time: steps x the step time at its per-rank micro-batch (`step_time`), each rank fed at
    most `workers` x the loader's measured rate per worker (a step faster than that waits for its data)."""
    if not row.steps_per_epoch or not row.rank_batch:
        return
    micro = row.rank_batch // accum
    row.latency_bound = row.device == "cuda" and micro < LATENCY_BOUND
    step = step_time(figures, kind, arch, method, micro)
    if step is None:
        return
    seconds, basis, how = step.seconds, step.basis, step.how
    loader = find_figure(figures, kind, "loader", arch) if workers else None
    if loader and micro / seconds > loader["value"] * workers:
        seconds, basis = micro / (loader["value"] * workers), "scaled"
        how += f"; loader-bound: {workers} workers x {_source(loader)}"
    elif not loader:
        how += "; the loader not counted (no rate measured for it here)"
    row.seconds = row.epochs * row.steps_per_epoch * accum * seconds
    row.basis, row.time_source = basis, f"{micro} per rank, {seconds * 1000:.1f} ms/step: {how}"


def _estimated_units(params: dict, run: dict, records, root: Path) -> int | None:
    """An epoch's units from the sources' records (before the shards exist): the records of `shards.sources` in
    `shards.splits` the method wants, counted in its unit (`train.epoch_unit`), capped by `epoch_samples`."""
    method = _method(run)
    if method is None:
        return None
    long = "long" in method.caption_kinds()
    splits = set(_get(params, "shards.splits") or [])
    wanted = []
    for name in _get(params, "shards.sources") or []:
        recs = records(name)
        if recs is None:
            return None
        wanted += [r for r in recs if (not r.split or r.split in splits)
                   and (bool(r.long_caption) if long else bool(r.captions))]
    units = len(wanted)
    if run["train"].get("epoch_unit") == "method":
        if method.units_table():                    # a prepared table's rows: counted once its stage has written it
            table = root / "data" / "prepared" / f"{method.units_table()}.parquet"
            if not table.is_file():
                return None
            import pyarrow.parquet as pq

            units = pq.ParquetFile(table).metadata.num_rows
        elif method.epoch_unit == "caption":
            units = sum(len(r.captions) for r in wanted)
    samples = int(run["train"].get("epoch_samples", 0) or 0)
    return min(units, samples) if samples else units


def _pretrain_row(row, params, compute, gpus, most, hardware, device, kind, figures, refusals, warnings, records):
    if _get(params, "model.pretrained"):
        row.kind, row.device = "export", "cpu"
        row.notes.append(f"model.pretrained={_get(params, 'model.pretrained')!r}: exported unchanged, one process")
        row.time_source = "seconds (an export)"
        return
    row.kind = "training"
    row.epochs = int(_get(params, "pretrain.epochs") or 0)
    global_batch = int(_get(params, "pretrain.batch_size") or 0)
    if not _training_ranks(row, global_batch, 1, "pretrain.batch_size", compute, gpus, most, hardware, device,
                           refusals, warnings):
        return
    images = 0
    for name in _get(params, "pretrain.sources") or []:
        recs = records(name)
        images += len(recs) if recs else 0
    if images:
        row.units, row.seen, row.repeated, row.coverage = images, images, 0, "estimated"
        row.steps_per_epoch = images // global_batch
    row.method = "clip"
    _training_time(row, figures, kind, str(_get(params, "model.name")), "clip", 1, 0)


def _item_row(row, st, params, gpus, most, hardware, device, kind, figures, records):
    row.kind, row.device = "items", device
    row.ranks, row.gpus = most * hardware.nodes, gpus[:most]
    source = st.args.get("source")
    if st.script == "stages/eval.py":
        sets = [f"{t}.{s}" for t, by in (_get(params, "eval.benchmarks") or {}).items() for s, cfg in (by or {}).items()
                if cfg]
        row.items, row.items_what = len(sets), "benchmark sets"
        f = find_figure(figures, kind, "eval_images", str(_get(params, "model.name")))
        if f:
            row.time_source = f"unknown: the sets' images are not counted here ({_source(f)})"
        return
    recs = records(source) if source else None
    if recs is not None:
        row.items, row.items_what = len(recs), "images"
    if st.script == "stages/segments.py":
        sam = _get(params, "segments.sam_checkpoint")
        what = f"sam_{_get(params, 'segments.sam_type')}" if sam else "cpu_segmenter"
        f = find_figure(figures, kind, "segments", what)
        if f and row.items:
            row.seconds = row.items * f["value"] / row.ranks
            row.basis = "measured" if row.ranks == 1 else "scaled"
            row.time_source = _source(f) + (f"; / {row.ranks} ranks (independent images)" if row.ranks > 1 else "")
        elif not sam:
            row.notes.append("segments.sam_checkpoint empty: the CPU segmenter (scikit-image), not SAM")
    elif st.script == "stages/lism.py":
        f = find_figure(figures, kind, "lism_crops")
        if f:
            row.time_source = f"unknown: the crops per image are known once segments has run ({_source(f)})"


def _data_row(row, st, params, figures, records, sizes):
    base = st.name.split("@", 1)[0]
    source = st.args.get("source")
    recs = records(source) if source else None
    if base == "negatives" and recs is not None:
        from clipfinetune.data.negatives.degla.generate import FILL_TYPES
        from clipfinetune.data.negatives.degla.validators import TYPES

        captions = len({" ".join(c.split()) for r in recs for c in r.captions})
        row.items, row.items_what = captions, "unique captions"
        backend = _get(params, "negatives.backend")
        if backend != "rules":
            row.llm_requests = captions * len(TYPES)
            row.notes.append(f"{captions:,} captions x {len(TYPES)} rewrite types (+ up to {len(FILL_TYPES)} per "
                             f"caption short of negatives.per_caption {_get(params, 'negatives.per_caption')}); "
                             f"answers cached in {_get(params, 'negatives.cache_dir')}")
            row.device = "cpu (LLM: server)" if backend == "server" else "cuda (vLLM offline)"
    elif base in ("word_regions", "negatives") and recs is not None:
        row.items, row.items_what = sum(len(r.captions) for r in recs), "captions"
    elif base in ("sentences",) and recs is not None:
        row.items, row.items_what = len(recs), "descriptions"
    elif base == "shards":
        splits = set(_get(params, "shards.splits") or [])
        n, images = 0, 0
        for name in _get(params, "shards.sources") or []:
            rs = records(name) or []
            n += sum(1 for r in rs if not r.split or r.split in splits)
            spec = _get(params, f"sources.{name}") or {}
            images += sizes(spec["images"]) or 0 if spec.get("images") else 0
        row.items, row.items_what = n, "samples (at most)"
        if row.outputs_bytes is None and images:
            row.outputs_bytes, row.outputs_note = images, "estimated (the sources' image files, not re-encoded)"
    f = find_figure(figures, "cpu", base) if base in ("word_regions", "sentences") else None
    if f and row.items:
        row.seconds, row.basis = row.items / f["value"], "measured"
        row.time_source = _source(f)


# ---------------------------------------------------------------------------------------------- the checks
def _declared_params(stages: list[DagStage], params: dict) -> list[Refusal]:
    """A stage that declares `compute` (the hardware: stages/_common.py reads it, no stage does, so the stage would
    stop with "declared params never read") or a key the params lack (`dvc repro` stops: missing params)."""
    out = []
    for st in stages:
        for key in st.declared:
            if key.split(".")[0] == "compute":
                out.append(Refusal(st.name, key, "declared in dvc.yaml, but compute is the hardware: no stage reads "
                                   "it as a param (stages/_common.py does), so the stage would stop with 'declared "
                                   "params never read' and every rank change would re-run it",
                                   [f"remove {key} from the stage's params in dvc.yaml"]))
            elif not _has(params, key):
                out.append(Refusal(st.name, key, "declared in dvc.yaml but absent from the params: dvc repro stops "
                                   "on missing params", [f"add {key} to the params file"]))
    return out


def _producing(stages: list[DagStage], base: str) -> list[str]:
    return [s.name for s in stages if s.name.split("@", 1)[0] == base]


def _sources_of_kind(params: dict, kind: str) -> list[str]:
    return [n for n in _get(params, "shards.sources") or [] if _kind_of_source(params, n) == kind]


def _tables_written(stages: list[DagStage], params: dict, runs: dict) -> list[Refusal]:
    """A run whose records need a table (word-region pairs, negatives, sentences, local pairs) that no stage of the
    DAG writes, or whose kind of caption no shard source holds: it would stop on "no records", or (a run without
    its local pairs) silently train as its global-only ablation."""
    out = []
    for name, run in runs.items():
        method = _method(run)
        for table, base in _tables_needed(run):
            if _producing(stages, base):
                continue
            kind = STAGE_SOURCE_KIND[base]
            fix_sources = _sources_of_kind(params, kind) or [n for n, s in (_get(params, "sources") or {}).items()
                                                            if _kind_of_source(params, n) == kind]
            chain = [base] + (["segments", "sentences"] if base == "lism" else [])
            fixes = [f"{b}.sources: [{fix_sources[0]}]" for b in chain] if fix_sources else []
            switches = method.tables_switched_off_by()
            if switches:
                fixes.append("or a run that reads none (a global-only run): "
                             + " and ".join(f"runs.{name}.{w}: 0" for w in switches))
            fixes.append("or apply the paper's recipe over the committed base (recipes/)")
            silently = " and would silently train as its global-only ablation" if base == "lism" else ""
            out.append(Refusal(f"train@{name}", f"{base}.sources",
                               f"run {name} (method {run['method']}) reads {table}, which stage {base} writes, but "
                               f"{base}.sources is {_get(params, f'{base}.sources')!r}: no stage writes them"
                               f"{silently}", fixes))
        for kind in sorted(method.caption_kinds() if method is not None else ()):
            if not _sources_of_kind(params, kind):
                wanted = "long-caption (DOCCI-format)" if kind == "long" else "short-caption (COCO-format)"
                have = [n for n, s in (_get(params, "sources") or {}).items() if _kind_of_source(params, n) == kind]
                out.append(Refusal(f"train@{name}", "shards.sources",
                                   f"run {name} (method {run['method']}) trains on {wanted} records, but shards.sources "
                                   f"{_get(params, 'shards.sources')!r} holds none",
                                   [f"shards.sources: [..., {n}]" for n in have[:1]]))
    return out


def _tables_unread(stages: list[DagStage], params: dict, runs: dict) -> list[str]:
    """Data stages that run although no run (and no other stage, and no eval set) reads their table: work for
    nothing (a recipe applied over another's leftovers)."""
    readers: set[str] = set()
    for run in runs.values():
        readers |= {base for _, base in _tables_needed(run)}
    benchmarks = json.dumps(_get(params, "eval.benchmarks") or {})
    if "data/evalsets/global_local" in benchmarks:
        readers.add("lism")                           # lism also writes the global-local test list
    for base in list(readers):
        readers |= set(DOWNSTREAM.get(base, []))
    if "lism" in readers:
        readers |= {"segments", "sentences"}
    out = []
    for base in STAGE_SOURCE_KIND:
        names = _producing(stages, base)
        if names and base not in readers:
            out.append(f"{', '.join(names)} runs but no run or evaluation set of this configuration reads its "
                       f"table: {base}.sources: [] leaves it out")
    return out


def _sample_sets_on_real_model(params: dict) -> list[Refusal]:
    """A real model (model.pretrained set) scored on the sample world's sets: meaningless numbers in the report."""
    if not _get(params, "model.pretrained"):
        return []
    keys = [f"eval.benchmarks.{task}.{name}" for task, by_set in (_get(params, "eval.benchmarks") or {}).items()
            for name, cfg in (by_set or {}).items() if cfg and "data/sample" in json.dumps(cfg)]
    if not keys:
        return []
    fixes = [f"{k}: null" for k in keys] + (["eval.report.set: real"] if _get(params, "eval.report.set") == "sample"
                                            else [])
    return [Refusal("", keys[0] if len(keys) == 1 else "eval.benchmarks",
                    f"{len(keys)} sample-world set(s) would score a real model (model.pretrained is set): "
                    f"{', '.join(keys)}", fixes)]


def _llm_beside_ranks(stages, params, compute, hardware, asks_llm: bool) -> tuple[list[Refusal], list[str]]:
    """vLLM beside training: a server on this host (negatives.base_url local) holds ~0.9 of a card; the ranks must
    not use that card (`compute.llm_gpus` keeps the last visible ones for it). `asks_llm`: a negatives stage of
    the DAG is not up to date, so it will ask the server."""
    neg = _producing(stages, "negatives")
    backend = _get(params, "negatives.backend")
    host = urlparse(str(_get(params, "negatives.base_url") or "")).hostname or ""
    local = host in LOCAL_HOSTS or host == os.uname().nodename
    uses_gpus = compute["device"] != "cpu" and hardware.gpus > 0
    refusals, warnings = [], []
    if not (neg and backend == "server" and local and uses_gpus):
        if compute["llm_gpus"] and uses_gpus:
            warnings.append(f"compute.llm_gpus {compute['llm_gpus']} keeps GPU(s) for an LLM server, but no "
                            "negatives stage asks one on this host: compute.llm_gpus: 0 gives them to the ranks")
        return refusals, warnings
    if not asks_llm:
        warnings.append(f"{', '.join(neg)} is up to date: the vLLM server is not needed (stop it; compute.llm_gpus: 0 "
                        "gives its card to the ranks)")
        return refusals, warnings
    if compute["llm_gpus"] == 0:
        last = hardware.gpus - 1
        refusals.append(Refusal(neg[0], "compute.llm_gpus",
                                f"negatives.base_url {_get(params, 'negatives.base_url')} is a vLLM server on this host: "
                                "it holds ~0.9 of a card, and with compute.llm_gpus 0 every model stage puts a rank on "
                                "that card too",
                                [(f"compute.llm_gpus: 1 and start the server on the last card: CUDA_VISIBLE_DEVICES="
                                  f"{last} vllm serve {_get(params, 'negatives.model')} --generation-config vllm"),
                                 "negatives.backend: offline (vLLM inside the stage: the card is free when it ends)"]))
    return refusals, warnings


def _missing_inputs(params, root, stages, leakage, timeout, warnings, asks_llm: bool = True) -> list[Refusal]:
    """Every missing input as a refusal (`clipfinetune.validate.check`); the LLM endpoint is probed only when a
    negatives stage will run (`asks_llm`): once its table is up to date the server may be stopped."""
    from clipfinetune.validate import check

    produced = [o for s in stages for o in s.outs]
    out = []
    for f in check(params, root, timeout, produced=produced, leakage_check=leakage, asks_llm=asks_llm):
        if f.missing and f.key.startswith("negatives."):
            out.append(Refusal("", f.key, f"no LLM endpoint: {f.message}",
                               [(f"start the server first: vllm serve {_get(params, 'negatives.model')} "
                                "--generation-config vllm (the recipe's header: on its own GPU)"),
                                "negatives.backend: offline"]))
        elif f.missing:
            out.append(Refusal("", f.key, f"missing input: {f.message}",
                               [f"{f.key}: a path that exists (params.real.yaml lists the layouts), or provide it"]))
        else:
            warnings.append(f"{f.key}: {f.message}")
    if not leakage:
        warnings.append("leakage between training and evaluation images: checked by the shards stage (or here with "
                        "--leakage: the first run hashes every training image)")
    return out


# ----------------------------------------------------------------------------------------------- output
COLUMNS = ("stage", "device", "ranks", "batch/rank", "steps x epochs", "units/epoch (seen, repeated)", "items",
           "in", "out", "LLM req", "time (basis)")


def _cells(r: dict) -> list[str]:
    batch = f"{r['rank_batch']} (of {r['global_batch']})" if r["rank_batch"] else "-"
    steps = f"{r['steps_per_epoch']:,} x {r['epochs']}" if r["steps_per_epoch"] else \
        (f"? x {r['epochs']}" if r["epochs"] else "-")
    if r["units"] is not None:
        units = f"{r['units']:,} ({r['seen']:,}, {r['repeated']:,}) {r['coverage']}"
    else:
        units = r["coverage"] or "-"
    items = f"{r['items']:,} {r['items_what']}" if r["items"] is not None else "-"
    device = r["device"] + (f" {','.join(r['gpus'])}" if r["gpus"] else "")
    out = _fmt_bytes(r["outputs_bytes"]) + (" est." if r["outputs_note"].startswith("estimated") else "")
    return [r["stage"], device, str(r["ranks"]), batch, steps, units, items, _fmt_bytes(r["inputs_bytes"]), out,
            _fmt_int(r["llm_requests"]),
            (f"{_fmt_seconds(r['seconds'])} {r['basis']}" if r["seconds"] is not None else "unknown")
            if r["kind"] != "export" else "seconds"]


def render(plan: dict) -> str:
    hw = plan["hardware"]
    lines = [f"clipfinetune plan: {hw['nodes']} node(s) x {hw['gpus']} GPU(s) ({hw['gpu_kind']}); model stages on "
             f"{hw['device']}" + (f", ranks on GPU(s) {','.join(hw['rank_gpus'])}" if hw["rank_gpus"] else "")]
    body = [_cells(r) for r in plan["stages"]]
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    lines += [fmt(COLUMNS), fmt(["-" * w for w in widths]), *map(fmt, body)]
    total = plan["total_seconds"]
    share = f"{plan['timed_stages']} of {plan['counted_stages']} stages"
    lines.append((f"time: at least {_fmt_seconds(total)} (the {share} with a measured or scaled time; "
                  f"GPU-hours at least {plan['gpu_hours']:.2f})" if total is not None else
                  f"time: unknown (none of the {plan['counted_stages']} stages has a measured rate here)")
                 + (f"; unknown: {', '.join(plan['unknown_time'])}" if plan["unknown_time"] else ""))
    papers = [f"  {r['stage']}: ours {_fmt_seconds(r['seconds'])} on {len(r['gpus']) or 1} GPU(s); the paper: "
              f"{r['paper']}" for r in plan["stages"] if r["paper"]]
    if papers:
        lines += ["the papers' stated cost beside ours:", *papers]
    disk = plan["disk"]
    copies = "once (linked from the cache)" if any(k in disk["cache_type"] for k in ("hardlink", "symlink")) else \
        "up to twice (workspace and cache: cache.type " + disk["cache_type"] + ")"
    lines.append(f"disk: outputs {_fmt_bytes(disk['outputs_bytes'])} as built or estimated "
                 f"({disk['stages_unsized']} stages not sized), held {copies}")
    lines += [f"  time of {r['stage']} ({r['basis']}): {r['time_source']}" for r in plan["stages"]
              if r["seconds"] is not None or r["time_source"].startswith("unknown:")]
    notes = [f"  {r['stage']}: {n}" for r in plan["stages"] for n in r["notes"]]
    if notes:
        lines += ["notes:", *notes]
    if plan["warnings"]:
        lines += ["warnings:", *[f"  - {w}" for w in plan["warnings"]]]
    if plan["refusals"]:
        lines += [f"REFUSED ({len(plan['refusals'])}): change these before `dvc repro`:",
                  *[f"  - {Refusal(**r)}" for r in plan["refusals"]]]
    else:
        lines.append("plan: OK, nothing refused")
    return "\n".join(lines)


def visible_hardware() -> tuple[int, str]:
    """(GPUs this process sees, the first one's name); (0, "cpu") without CUDA."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return 0, "cpu"
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clipfinetune plan", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: those visible here)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: $SLURM_JOB_NUM_NODES, else 1)")
    p.add_argument("--params", default="params.yaml", help="the applied params file (default params.yaml)")
    p.add_argument("--root", default=None, help="project root (default: the params file's folder)")
    p.add_argument("--gpu-kind", default=None, help="the GPU's name for the measured rates, e.g. 'NVIDIA H200' "
                   "(default: the visible GPU's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--leakage", action="store_true", help="also compare training and evaluation images (slow once)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for the LLM endpoint check")
    args = p.parse_args(argv)
    import yaml

    t0 = time.perf_counter()
    params_path = Path(args.params)
    if not params_path.is_file():
        print(f"clipfinetune plan: {params_path} does not exist", file=sys.stderr)
        return 1
    root = Path(args.root) if args.root else params_path.resolve().parent
    params = yaml.safe_load(params_path.read_text()) or {}
    seen, name = visible_hardware() if args.gpus is None or args.gpu_kind is None else (0, "cpu")
    gpus = seen if args.gpus is None else args.gpus
    kind = args.gpu_kind or (name if seen else ("cpu" if gpus == 0 else "unknown GPU (--gpu-kind)"))
    nodes = args.nodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    try:
        stages = dag_stages(root, params_path)
    except Exception as e:  # noqa: BLE001  dvc.yaml's ${...} or foreach do not resolve: `dvc repro` would stop too
        print(f"REFUSED: DVC cannot read the pipeline of {root} with {params_path}: {type(e).__name__}: {e}")
        return 1
    plan = make_plan(params, root, Hardware(gpus, nodes, kind), stages=stages,
                     leakage=args.leakage, timeout=args.timeout)
    plan["seconds_to_plan"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(plan, indent=2, default=str) if args.json else render(plan))
    return 0 if plan["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
