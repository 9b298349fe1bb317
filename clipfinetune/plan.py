"""`clipfinetune plan`: what `dvc repro` would run in the applied configuration, on N GPUs, and what would stop it.

    clipfinetune plan [--gpus N] [--nodes M] [--params params.yaml] [--gpu-kind NAME] [--json] [--leakage]
    python -m clipfinetune.plan ...

It reads the params file, asks DVC for the stages of its DAG (foreach bodies and `[]` sources exactly as `dvc repro`
expands them) and resolves, per stage: device, ranks (clipfinetune.compute's rules, the ones the stages' launcher
applies), per-rank batch, steps per epoch, units seen and repeated per epoch (exact from the shards' index through
`clipfinetune.data.loader.epoch_coverage` when the shards exist; before, estimated from the sources' record counts
and marked so), input and output sizes, LLM requests, and a wall time from measured throughput
(benchmarks/calibration.json, each figure with its source; "unknown" where nothing was measured).

It exits 1 BEFORE any work, naming the param to change and values that would work, when the configuration would stop
or silently degrade a run: a batch that does not split over the ranks, a stage declaring params it will not read
(`compute`, the hardware) or that the params lack, a run reading a table that no stage of the configuration writes
(e.g. GOAL's local pairs with `lism.sources: []`), a GPU shared by a vLLM server and the ranks, sample-world sets
scored on a real model, epoch coverage under 100%, and every missing input (`clipfinetune.validate.check`). Warnings
(idle GPUs, stages whose table no run reads, several nodes) do not fail it.

`make_plan(params, root, ...)` is the library entry (a dict in, a dict out); only `main` reads the params file.
"""
from __future__ import annotations

import argparse
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
from clipfinetune import host
from clipfinetune.runs import batch_param, resolve_runs

CALIBRATION = Path("benchmarks") / "calibration.json"      # relative to the project root
# the prepared table a method's records need, and the data stage that writes it ("local pairs" only when the run's
# local terms are on: GOAL without them is its global-only ablation)
TABLES = {"harmoclip": [("word-region pairs", "word_regions")], "degla": [("hard negatives", "negatives")],
          "mulclip": [("sentences", "sentences")], "goal": [("local pairs", "lism")]}
GOAL_LOCAL_WEIGHTS = ("lambda_local", "lambda_tsl")
LONG_CAPTION_METHODS = {"goal", "mulclip"}        # records with a long caption (DOCCI-format); the rest short captions
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
    time_source: str = "unknown"
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- the DAG, by DVC
@dataclass
class DagStage:
    name: str
    script: str
    args: dict
    declared: list[str]
    deps: list[str]
    outs: list[str]


def dag_stages(root: Path, params_file: Path | None = None) -> list[DagStage]:
    """The stages `dvc repro` would run for these params, in DVC's topological order, as DVC expands them. With a
    params file other than <root>/params.yaml, dvc.yaml is resolved against it in a scratch copy (no data)."""
    root = Path(root).resolve()
    own = params_file is None or Path(params_file).resolve() == root / "params.yaml"
    where = root if own else Path(tempfile.mkdtemp(prefix="clipfinetune-plan-"))
    try:
        if not own:
            (where / ".dvc").mkdir()
            (where / ".dvc" / "config").write_text("[core]\n    no_scm = true\n    analytics = false\n")
            shutil.copyfile(root / "dvc.yaml", where / "dvc.yaml")
            shutil.copyfile(params_file, where / "params.yaml")
        return _read_dag(where)
    finally:
        if not own:
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
            out.append(DagStage(stage.name, script, args, declared,
                                [d.def_path for d in stage.deps if d.def_path != "params.yaml" and
                                 not d.def_path.startswith(("stages/", "clipfinetune/"))],
                                [o.def_path for o in stage.outs]))
    return out


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


def find_figure(figures: list[dict], device: str, what: str, arch: str = "", method: str = "") -> dict | None:
    """The measured figure of `what` (train_step, segments, word_regions, ...) on this device kind (a figure's device
    name contained in it, case-insensitive: "H200" in "NVIDIA H200"), for this architecture and method."""
    device = device.lower()
    for f in figures:
        if f["what"] == what and f.get("device", "").lower() in device and f.get("device") \
                and f.get("arch", "") in ("", arch) and f.get("method", "") in ("", method):
            return f
    return None


def _source(f: dict) -> str:
    return f"{f['value']:g} {f['unit']} on {f['device']} ({f['source']})"


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


def _methods_of(run: dict) -> list[str]:
    """A run's methods: its own, or for `custom` the methods whose terms it mixes ("<method>.<term>")."""
    if run["method"] != "custom":
        return [run["method"]]
    return sorted({t.split(".")[0] for t in (run["config"].get("terms") or {})})


def _tables_needed(run: dict) -> list[tuple[str, str]]:
    out = []
    for m in _methods_of(run):
        for table, stage in TABLES.get(m, []):
            if m == "goal" and run["method"] == "goal" and not any(
                    float(run["config"].get(w, 1.0) or 0) for w in GOAL_LOCAL_WEIGHTS):
                continue                                  # the global-only ablation reads no local pairs
            out.append((table, stage))
    return out


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
              leakage: bool = False, timeout: float = 5.0, stage_up_to_date=None) -> dict:
    """The plan as a dict: hardware, stages (StageRow as dicts, DVC's order), refusals, warnings, total_seconds, ok.
    `stages`: DVC's view of the DAG (`dag_stages`); `stage_up_to_date(name) -> bool` answers whether DVC would skip
    a stage (only the vLLM check asks it)."""
    root = Path(root)
    stages = dag_stages(root) if stages is None else stages
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
    r, w = _llm_beside_ranks(stages, params, compute, hardware, stage_up_to_date)
    refusals += r
    warnings += w
    refusals += _missing_inputs(params, root, stages, leakage, timeout, warnings)

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
    known = [r.seconds for r in rows if r.seconds is not None]
    sized = [r.outputs_bytes for r in rows if r.outputs_bytes is not None]
    disk = {"outputs_bytes": sum(sized) if sized else None, "stages_unsized": len(rows) - len(sized),
            "cache_type": _cache_type(root)}
    return {"disk": disk, "hardware": {**asdict(hardware), "device": device, "rank_gpus": gpus, "compute": compute},
            "stages": [asdict(r) for r in rows], "refusals": [asdict(r) for r in refusals], "warnings": warnings,
            "total_seconds": sum(known) if known else None,
            "unknown_time": _grouped([r.stage for r in rows if r.seconds is None and r.kind != "export"
                                      and r.stage not in MINOR]),
            "ok": not refusals}


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
                                      world_size=row.ranks, num_workers=host.count("train", row.ranks),
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
                                    f"at {row.ranks} ranks x {host.count('train', row.ranks)} workers",
                                    ["a smaller shards.maxcount (more shards per reader)",
                                     "fewer loader workers (CLIPFINETUNE_WORKERS, docs/scale.md)"]))
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
    f = find_figure(figures, kind, "train_step", str(_get(params, "model.name")), method)
    if f and row.steps_per_epoch:
        samples = row.epochs * row.steps_per_epoch * global_batch
        row.seconds = samples / (f["value"] * row.ranks)
        row.time_source = f"{_source(f)}; x {row.ranks} ranks, linear (assumed); step only, no loader"


def _estimated_units(params: dict, run: dict, records, root: Path) -> int | None:
    """An epoch's units from the sources' records (before the shards exist): the records of `shards.sources` in
    `shards.splits` the method wants, counted in its unit (`train.epoch_unit`), capped by `epoch_samples`."""
    methods = _methods_of(run)
    long = any(m in LONG_CAPTION_METHODS for m in methods)
    splits = set(_get(params, "shards.splits") or [])
    wanted = []
    for name in _get(params, "shards.sources") or []:
        recs = records(name)
        if recs is None:
            return None
        wanted += [r for r in recs if (not r.split or r.split in splits)
                   and (bool(r.long_caption) if long else bool(r.captions))]
    units = len(wanted)
    if run["train"].get("epoch_unit") == "method" and run["method"] != "custom":
        if run["method"] == "harmoclip":            # word-region pairs: counted once word_regions has written them
            table = root / "data" / "prepared" / "word_regions.parquet"
            if not table.is_file():
                return None
            import pyarrow.parquet as pq

            units = pq.ParquetFile(table).metadata.num_rows
        elif not long:
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
    f = find_figure(figures, kind, "train_step", str(_get(params, "model.name")), "clip")
    if f and row.steps_per_epoch:
        row.seconds = row.epochs * row.steps_per_epoch * global_batch / (f["value"] * row.ranks)
        row.time_source = f"{_source(f)}; x {row.ranks} ranks, linear (assumed)"


def _item_row(row, st, params, gpus, most, hardware, device, kind, figures, records):
    row.kind, row.device = "items", device
    row.ranks, row.gpus = most * hardware.nodes, gpus[:most]
    source = st.args.get("source")
    if st.script == "stages/eval.py":
        sets = [f"{t}.{s}" for t, by in (_get(params, "eval.benchmarks") or {}).items() for s, cfg in (by or {}).items()
                if cfg]
        row.items, row.items_what = len(sets), "benchmark sets"
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
            row.time_source = f"{_source(f)}; / {row.ranks} ranks"
        elif not sam:
            row.notes.append("segments.sam_checkpoint empty: the CPU segmenter (scikit-image), not SAM")


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
        row.seconds = row.items / f["value"]
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
    DAG writes, or whose kind of caption no shard source holds: it would stop on "no records", or (GOAL without
    local pairs) silently train as its global-only ablation."""
    out = []
    for name, run in runs.items():
        for table, base in _tables_needed(run):
            if _producing(stages, base):
                continue
            kind = STAGE_SOURCE_KIND[base]
            fix_sources = _sources_of_kind(params, kind) or [n for n, s in (_get(params, "sources") or {}).items()
                                                            if _kind_of_source(params, n) == kind]
            chain = [base] + (["segments", "sentences"] if base == "lism" else [])
            fixes = [f"{b}.sources: [{fix_sources[0]}]" for b in chain] if fix_sources else []
            if run["method"] == "goal":
                fixes.append(f"or a global-only run: runs.{name}.lambda_local: 0 and runs.{name}.lambda_tsl: 0")
            fixes.append("or apply the paper's recipe over the committed base (recipes/)")
            silently = " and would silently train as its global-only ablation" if base == "lism" else ""
            out.append(Refusal(f"train@{name}", f"{base}.sources",
                               f"run {name} (method {run['method']}) reads {table}, which stage {base} writes, but "
                               f"{base}.sources is {_get(params, f'{base}.sources')!r}: no stage writes them"
                               f"{silently}", fixes))
        kinds = {"long" if m in LONG_CAPTION_METHODS else "short" for m in _methods_of(run)}
        for kind in kinds:
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
        readers.add("lism")                           # lism also writes GOAL's joint test list
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


def _llm_beside_ranks(stages, params, compute, hardware, up_to_date) -> tuple[list[Refusal], list[str]]:
    """vLLM beside training: a server on this host (negatives.base_url local) holds ~0.9 of a card; the ranks must
    not use that card (`compute.llm_gpus` keeps the last visible ones for it)."""
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
    if up_to_date is not None and all(up_to_date(n) for n in neg):
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


def _missing_inputs(params, root, stages, leakage, timeout, warnings) -> list[Refusal]:
    from clipfinetune.validate import check

    produced = [o for s in stages for o in s.outs]
    out = []
    for f in check(params, root, timeout, produced=produced, leakage_check=leakage):
        if f.missing and f.key.startswith("negatives."):
            out.append(Refusal("", f.key, f"no LLM endpoint: {f.message}",
                               [(f"start the server first: vllm serve {_get(params, 'negatives.model')} "
                                "--generation-config vllm (recipes/degla.yaml: on its own GPU)"),
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
           "in", "out", "LLM req", "time")


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
            _fmt_int(r["llm_requests"]), _fmt_seconds(r["seconds"]) if r["kind"] != "export" else "seconds"]


def render(plan: dict) -> str:
    hw = plan["hardware"]
    lines = [f"clipfinetune plan: {hw['nodes']} node(s) x {hw['gpus']} GPU(s) ({hw['gpu_kind']}); model stages on "
             f"{hw['device']}" + (f", ranks on GPU(s) {','.join(hw['rank_gpus'])}" if hw["rank_gpus"] else "")]
    body = [_cells(r) for r in plan["stages"]]
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    lines += [fmt(COLUMNS), fmt(["-" * w for w in widths]), *map(fmt, body)]
    total = plan["total_seconds"]
    lines.append(f"estimated time of the stages with a measured rate: {_fmt_seconds(total)}"
                 + (f"; unknown (nothing measured): {', '.join(plan['unknown_time'])}" if plan["unknown_time"] else ""))
    disk = plan["disk"]
    copies = "once (linked from the cache)" if any(k in disk["cache_type"] for k in ("hardlink", "symlink")) else \
        "up to twice (workspace and cache: cache.type " + disk["cache_type"] + ")"
    lines.append(f"disk: outputs {_fmt_bytes(disk['outputs_bytes'])} as built or estimated "
                 f"({disk['stages_unsized']} stages not sized), held {copies}")
    sources = sorted({r["time_source"] for r in plan["stages"] if r["seconds"] is not None})
    lines += [f"  rate: {s}" for s in sources]
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


def _up_to_date(root: Path):
    def ask(stage: str) -> bool:
        from dvc.repo import Repo

        with Repo(str(root)) as repo:
            return not repo.status(targets=[stage])
    return ask


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
    own = params_path.resolve() == root.resolve() / "params.yaml"
    try:
        stages = dag_stages(root, params_path)
    except Exception as e:  # noqa: BLE001  dvc.yaml's ${...} or foreach do not resolve: `dvc repro` would stop too
        print(f"REFUSED: DVC cannot read the pipeline of {root} with {params_path}: {type(e).__name__}: {e}")
        return 1
    plan = make_plan(params, root, Hardware(gpus, nodes, kind), stages=stages,
                     leakage=args.leakage, timeout=args.timeout, stage_up_to_date=_up_to_date(root) if own else None)
    plan["seconds_to_plan"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(plan, indent=2, default=str) if args.json else render(plan))
    return 0 if plan["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
