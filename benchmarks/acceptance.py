"""`python -m benchmarks.acceptance`: the GPU acceptance run. One command, one table, at most 8 minutes on one
H100/H200, and on a GPU a second one for the compiled step table (`--parts compiled`); on a machine without CUDA
every part in one command at a tiny size (`--tiny`, what CI runs), saying so.

Parts, in order, each catching its own errors and writing its rows as it finishes (a run stopped mid-way keeps them):
1. env: the device, the packages each part needs (`NEEDS`) and what is missing.
2. the miniature real profile (tests/fixtures/real_tree.py's tree, params.real.yaml applied with
   `clipfinetune.project.profile`, compute shrunk by `overrides`): `dvc repro shards` on cuda, SAM vit_b with random
   weights (thresholds 0, so random masks still give segments), LISM, a fake OpenAI-compatible server for the negatives.
3. the step table: every method's `Trainer.train_step` (ViT-B-16 random init, 224 px, bf16) at per-rank batch 128
   and 2 on a batch its `make_example` builds from part 2's shards (every annotation is there), against a bf16
   GEMM's rate; the figures as calibration rows (`<out>/calibration.json`, and benchmarks/calibration.json on a GPU).
4. `benchmarks --gpu`'s other rows (`gpu.extra_rows`): Trainer.fit against open_clip_train end to end, loader
   against step, eval images/s, SAM s/image, LISM crops/s.
5. each recipe's DAG (`recipes/<paper>.yaml` applied after params.real.yaml in its own copy, `dvc repro`, every
   stage; one DVC cache, so a stage another copy ran with the same inputs is restored from DVC's run cache): its
   wall time, the stages it ran, the slowest, the device each stage recorded, one metrics file per run.
6. `compiled`: every method's step at batch 128 under `train.compile: true` beside its eager twin: the speed-up, the
   warm-up (compilation included) and the steps after which it pays.
Every child process gets this process's PYTHONPATH after the repository (`common.pythonpath`), so packages installed
into folders on PYTHONPATH (`pip install --target`) are found by the trainer, open_clip_train, dvc and its stages.
No part is started to be killed by the budget: it starts only with its reserve (`step_reserve`, `dag_reserve`)
left, else its rows are SKIP naming the `--parts` that runs it alone.
On a GPU a row whose peak GPU memory stays under `SILENT_GB` ran on the CPU without saying so: its status is
"CPU!" (a Trainer built without a process group uses the CPU, and says nothing). On the CPU nothing is a GPU figure:
the table's title says so. The table goes to stdout and `<out>/acceptance.md`, every row to `<out>/rows.jsonl` as it
comes; scratch under benchmarks/_work/acceptance/. Exit 1 if a row failed. How to carry what a GPU machine lacks:
benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from .common import ROOT, WORK, pythonpath

RECIPES = ("harmoclip", "fsc_clip", "goal", "degla", "mulclip")
PARTS = ("steps", "rows", "dags", "compiled")
SILENT_GB = 0.05               # peak GPU memory below this on a GPU: the work ran on the CPU
# what each part imports beyond torch/numpy/pandas/PIL (the GPU image has those; see benchmarks/README.md)
NEEDS = {
    "steps": ["open_clip", "webdataset"],
    "rows": ["open_clip", "open_clip_train", "webdataset", "segment_anything"],
    "dag": ["dvc", "dvclive", "open_clip", "webdataset", "pycocotools", "segment_anything", "spacy", "nltk",
            "pyinflect", "ruamel.yaml", "aiohttp", "skimage"],
}
SIZES = {   # the GPU run and CI's CPU rehearsal; rows' sizes are gpu.SIZES
    # backend: torch.compile's for the compiled step rows (the CPU rehearsal checks the path, not the kernels);
    # step_reserve: seconds a step row may take at most (compilation included): a row starts only with that much left
    "gpu": {"device": "cuda:0", "arch": None, "batch": 128, "latency_batch": 2, "precision": "bf16", "warmup": 2,
            "steps": 6, "backend": "inductor", "step_reserve": 60, "dag_reserve": 240, "jobs": 5, "budget": 480,
            "parts": "steps,rows,dags", "sam": True,
            "sam_points": 8, "workers": 2},
    "tiny": {"device": "cpu", "arch": "cft-tiny-vit", "batch": 4, "latency_batch": 2, "precision": "fp32",
             "warmup": 1, "steps": 2, "backend": "aot_eager", "step_reserve": 20, "dag_reserve": 600, "jobs": 2,
             "budget": 3600,
             "parts": ",".join(PARTS),
             "sam": False, "sam_points": 8, "workers": 0},
}
CODE = ["stages", "clipfinetune", "recipes", "dvc.yaml", "params.yaml", "params.real.yaml", ".dvc/config",
        ".dvcignore"]


# ---------------------------------------------------------------------------------------------------- the table
class Report:
    """Rows as they come: appended to rows.jsonl and the whole table rewritten to acceptance.md after each."""
    HEAD = ("part", "row", "value", "unit", "device", "peak GPU GB", "status", "note")

    def __init__(self, out: Path, title: str):
        self.out, self.title, self.rows = out, title, []
        self.lock = threading.Lock()          # the recipes' DAGs report from their threads
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.jsonl").write_text("")

    def add(self, part: str, row: str, value=None, unit: str = "", status: str = "info", device: str = "",
            peak_gb: float | None = None, note: str = "", **details) -> dict:
        rec = {"part": part, "row": row, "value": value, "unit": unit, "device": device, "peak_gb": peak_gb,
               "status": status, "note": note, "details": details,
               "at": datetime.datetime.now().isoformat(timespec="seconds")}
        with self.lock:
            self.rows.append(rec)
            with open(self.out / "rows.jsonl", "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
            (self.out / "acceptance.md").write_text(self.table() + "\n")
        print(f"[acceptance] {part} | {row} | {_fmt(value)} {unit} | {status} {note}", file=sys.stderr, flush=True)
        return rec

    def table(self) -> str:
        cells = [[r["part"], r["row"], _fmt(r["value"]), r["unit"], r["device"], _fmt(r["peak_gb"]), r["status"],
                  r["note"].replace("|", "/")] for r in self.rows]
        lines = [self.title, "", "| " + " | ".join(self.HEAD) + " |", "|" + "---|" * len(self.HEAD)]
        return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in cells])

    @property
    def failed(self) -> bool:
        return any(r["status"] in ("FAIL", "ERROR", "CPU!") for r in self.rows)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"
    return str(x)


def gpu_status(device: str, peak_gb: float | None, ok: bool = True) -> str:
    """PASS, FAIL, or CPU! where work meant for a GPU left its memory untouched (peak under SILENT_GB)."""
    if not ok:
        return "FAIL"
    if device.startswith("cuda") and (peak_gb is None or peak_gb < SILENT_GB):
        return "CPU!"
    return "PASS"


class GpuMemory:
    """The device-wide peak of GPU memory in use during the block, over its level at the start (polled from
    `torch.cuda.mem_get_info`, so subprocesses count too), in GB; 0.0 on a machine without CUDA."""

    def __init__(self, every_s: float = 0.2):
        import torch

        self.cuda, self.every_s, self.peak_gb = torch.cuda.is_available(), every_s, 0.0

    def _used(self) -> float:
        import torch

        free, total = torch.cuda.mem_get_info()
        return (total - free) / 1e9

    def __enter__(self):
        if self.cuda:
            self.base, self._stop = self._used(), threading.Event()
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()
        return self

    def _poll(self):
        while not self._stop.wait(self.every_s):
            self.peak_gb = max(self.peak_gb, self._used() - self.base)

    def __exit__(self, *exc):
        if self.cuda:
            self._stop.set()
            self._thread.join()
            self.peak_gb = max(self.peak_gb, self._used() - self.base)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def run_part(report: Report, part: str, fn, *args, **kwargs) -> object:
    """`fn(*args, **kwargs)`; an exception becomes an ERROR row naming it (the traceback on stderr), never the end
    of the run."""
    t0 = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (each part reports its own failure; the others still run)
        traceback.print_exc()
        report.add(part, "error", round(time.perf_counter() - t0, 1), "s", status="ERROR",
                   note=f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}")
        return None


def missing(part: str) -> list[str]:
    out = []
    for name in NEEDS[part]:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            out.append(name)
    return out


# ---------------------------------------------------------------------------------------- the miniature projects
HOST_COUNTS: dict[str, str] = {}      # clipfinetune/host.py's variables for the DAGs' stages: `host_counts`


def host_counts(size: dict) -> dict[str, str]:
    """The stages' worker and thread counts (clipfinetune/host.py's environment variables): `workers` loader, eval
    and LISM workers and, with the DAGs side by side, one eval thread each on the CPU, two on a GPU's host."""
    from clipfinetune.host import VARIABLES

    return {VARIABLES["train"]: str(size["workers"]), VARIABLES["eval"]: str(size["workers"]),
            VARIABLES["lism"]: str(size["workers"]), VARIABLES["eval_threads"]: "2" if size["sam"] else "1"}


@functools.cache
def subprocess_env(bin_dir: Path) -> dict:
    """Stages run as `python stages/<name>.py` (dvc.yaml): `python` is this interpreter (a script in `bin_dir`, first
    on PATH), whatever PATH holds. PYTHONPATH: the repository, then every folder this process's PYTHONPATH names, so
    every child (dvc, its stages, their ranks and workers) imports from the same place as this process, packages
    installed into folders on PYTHONPATH included (`common.pythonpath`)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    # a script, not a link (a venv's python finds its packages by its own path); written beside and renamed over,
    # so an earlier link there is replaced, never written through
    tmp = bin_dir / f".python-{os.getpid()}"
    tmp.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    tmp.chmod(0o755)
    os.replace(tmp, bin_dir / "python")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "DVC_NO_ANALYTICS": "1",
           "PYTHONPATH": pythonpath(ROOT), **HOST_COUNTS}
    for k in ("DVC_STAGE", "DVC_ROOT"):
        env.pop(k, None)
    return env


def run_cmd(cwd: Path, cmd: list[str], timeout: float) -> tuple[int, str, list[tuple[float, str]]]:
    """(returncode, output, [(seconds since the start, line)]) of `cmd` in the project `cwd`, every line timed as it
    comes; on timeout the command's whole process group is killed and -9 returned."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=subprocess_env(cwd.parent / "bin"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0, lines = time.perf_counter(), []

    def read():
        for line in proc.stdout:
            lines.append((time.perf_counter() - t0, line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(timeout, 1))
        code, note = proc.returncode, ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code, note = -9, f"\n[acceptance] killed after {timeout:.0f} s (time budget)"
    reader.join()
    return code, "".join(line for _, line in lines) + note, lines


def stage_seconds(lines: list[tuple[float, str]], end: float) -> dict[str, float]:
    """{stage: seconds from its 'Running stage' line to the next one (the last: to `end`)} of a `dvc repro` log;
    a stage restored from the run cache shows as the seconds of its restore."""
    import re

    found = ((t, re.search(r"Running stage '([^']+)'|Stage '([^']+)' is cached", line)) for t, line in lines)
    starts = [(t, m.group(1) or m.group(2)) for t, m in found if m]
    return {name: round((starts[i + 1][0] if i + 1 < len(starts) else end) - t, 1)
            for i, (t, name) in enumerate(starts)}


def build_datasets(root: Path, size: dict, archs: set[str]) -> dict:
    """The miniature tree under root/datasets, random-init stand-ins of the weights (one export per architecture;
    the tiny size uses `cft-tiny-vit` for all) and, on a GPU, a random SAM vit_b checkpoint. Returns their paths."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from fixtures import real_tree

    from clipfinetune.models import export_model, load_model

    shutil.rmtree(root, ignore_errors=True)
    real_tree.build(root)
    weights = {}
    for arch in sorted({size["arch"]} if size["arch"] else archs):
        folder = root / "datasets" / "weights" / f"random-{arch}"
        torch.manual_seed(0)
        export_model(load_model(arch), folder)
        weights[arch] = folder
    out = {"weights": weights, "sam": ""}
    if size["sam"]:
        from segment_anything import sam_model_registry

        out["sam"] = root / "datasets" / "weights" / "sam_vit_b_random.pth"
        torch.save(sam_model_registry["vit_b"](checkpoint=None).state_dict(), out["sam"])
    return out


def overrides(size: dict, weights: Path, sam, base_url: str) -> dict:
    """The compute a miniature tree needs (paths and layouts stay the profile's): tests/scale/test_real_profile_dag's
    CPU overrides, with SAM vit_b on a GPU (random weights, thresholds 0), and no GPU kept for the LLM server (a
    stand-in on the CPU). Worker and thread counts are no params: `host_counts`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.project import TINY

    rel = os.path.relpath(weights, weights.parents[2])            # datasets/weights/<name>, as the profile names it
    # SAM's prompt grid sized down (the rows time it at 32 x 32): with thresholds 0 every point's masks are kept
    segments = {"sam_checkpoint": os.path.relpath(sam, sam.parents[2]), "sam_type": "vit_b", "pred_iou_thresh": 0.0,
                "stability_score_thresh": 0.0, "points_per_side": size["sam_points"]} if sam else {"sam_checkpoint": ""}
    return {"sample": TINY["sample"], "model": {"pretrained": f"local-dir:{rel}"},
            "lism": {"model": rel, "pretrained": "", "batch_size": 32},
            "segments": segments,
            "negatives": {"concurrency": 2, "timeout": 20, "max_retries": 1, "backoff": 0.1, "base_url": base_url},
            "shards": {"maxcount": 4},
            "eval": {"batch_size": 64},
            "compute": {"llm_gpus": 0}}        # the stand-in LLM server holds no GPU (DeGLA's recipe keeps one)


SHRINK = {"epochs": 1, "batch_size": 2, "warmup": 1, "checkpoint_every": 0, "epoch_samples": 0}


def shrink_train(train) -> None:
    """A few steps per run: every `train` setting of SHRINK, shared or a method's own (`train.<method>.*`)."""
    for key, value in train.items():
        if isinstance(value, dict):
            shrink_train(value)
        elif key in SHRINK:
            train[key] = SHRINK[key]


def make_project(dst: Path, datasets: Path, profiles: list[str], size: dict, built: dict, base_url: str) -> dict:
    """A copy of the code (no git: DVC runs with `core.no_scm`) over the shared miniature tree, the profiles applied
    with `clipfinetune.project.profile` and the compute shrunk. Returns the applied params."""
    from ruamel.yaml import YAML

    from clipfinetune.project.profile import apply, deep_merge, load

    shutil.rmtree(dst, ignore_errors=True)
    for rel in CODE:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "tmp"))
        else:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    # one DVC cache for every copy: a stage another copy already ran with the same command, deps and params is
    # restored from DVC's run cache instead of run again (the recipes' DAGs share the base DAG's data stages)
    cache = dst.parent / "dvc-cache"
    (dst / ".dvc" / "config.local").write_text(f"[core]\n    no_scm = true\n[cache]\n    dir = {cache}\n")
    for folder in ("data/prepared", "data/evalsets", "data/plan"):
        (dst / folder).mkdir(parents=True, exist_ok=True)
    (dst / "datasets").symlink_to(datasets, target_is_directory=True)
    apply([str(dst / p) for p in profiles], str(dst / "params.yaml"))
    params = load(dst / "params.yaml")
    arch = size["arch"] or params["model"]["name"]
    deep_merge(params, overrides(size, built["weights"][arch], built["sam"], base_url))
    shrink_train(params["train"])
    with open(dst / "params.yaml", "w") as f:
        YAML().dump(params, f)
    return json.loads(json.dumps(params))


def stage_devices(project: Path) -> dict[str, str]:
    """The device each stage recorded in its outputs (segments, lism, train@<run>, eval@<model>)."""
    found = {}
    for rel, key in (("data/prepared/segments.meta.json", "segments"), ("data/prepared/local_pairs.meta.json", "lism")):
        if (project / rel).is_file():
            found[key] = json.loads((project / rel).read_text()).get("device", "?")
    for f in sorted((project / "dvclive" / "train").glob("*/data.json")):
        found[f"train@{f.parent.name}"] = json.loads(f.read_text()).get("device", "?")
    for f in sorted((project / "metrics").glob("*.json")):
        meta = json.loads(f.read_text()).get("meta")
        if isinstance(meta, dict) and "device" in meta:
            found[f"eval@{f.stem}"] = meta["device"]
    return found


def dag(report: Report, part: str, project: Path, target: list[str], size: dict, budget: Budget) -> bool:
    """`dvc repro <target>` in `project`: its rows (wall time, stages run, devices recorded)."""
    import re

    t0 = time.perf_counter()
    with GpuMemory() as mem:
        rc, out, lines = run_cmd(project, [sys.executable, "-m", "dvc", "repro", *target], budget.left())
    seconds = time.perf_counter() - t0
    (report.out / f"{part.replace(' ', '_')}.log").write_text(out)
    ran = re.findall(r"Running stage '([^']+)'", out)
    restored = re.findall(r"Stage '([^']+)' is cached - skipping run, checking out outputs", out)
    per_stage = stage_seconds(lines, seconds)
    slowest = sorted(per_stage.items(), key=lambda kv: -kv[1])[:3]
    devices = stage_devices(project)
    wrong = sorted(k for k, v in devices.items() if not str(v).startswith(size["device"].split(":")[0]))
    note = (f"{len(ran)} stages ({len(restored)} from the run cache), slowest "
            + ", ".join(f"{k} {v:.0f} s" for k, v in slowest) + f"; devices {sorted(set(devices.values()))}"
            + (f"; not on {size['device']}: {wrong}" if wrong else ""))
    if rc:
        note = f"dvc repro exit {rc}: {out.strip().splitlines()[-1][:200] if out.strip() else ''}; " + note
    report.add(part, "dvc repro " + " ".join(target) if target else "dvc repro", round(seconds, 1), "s",
               status=gpu_status(size["device"], mem.peak_gb if mem.cuda else None, rc == 0 and not wrong)
               if size["device"].startswith("cuda") else ("PASS" if rc == 0 and not wrong else "FAIL"),
               device=size["device"], peak_gb=mem.peak_gb if mem.cuda else None, note=note, ran=ran, devices=devices,
               restored=restored, stage_seconds=per_stage)
    return rc == 0


def recipe_dag(report: Report, name: str, work: Path, built: dict, size: dict, base_url: str,
               budget: Budget) -> None:
    project = work / f"recipe-{name}"
    params = make_project(project, work / "tree" / "datasets", ["params.real.yaml", f"recipes/{name}.yaml"], size,
                          built, base_url)
    if dag(report, f"dag {name}", project, [], size, budget):
        runs = sorted(params["runs"])
        lacking = [r for r in runs if not (project / "metrics" / f"{r}.json").is_file()]
        report.add(f"dag {name}", "metrics per run", len(runs) - len(lacking), f"of {len(runs)}",
                   status="FAIL" if lacking else "PASS", note=f"missing {lacking}" if lacking else ", ".join(runs))


def recipe_dags(report: Report, recipes: list[str], work: Path, built: dict, size: dict, base_url: str,
                budget: Budget) -> None:
    """Every recipe's DAG, `jobs` side by side, started only with `dag_reserve` seconds of the budget left (a DAG
    is never started to be killed half-way)."""
    from concurrent.futures import ThreadPoolExecutor

    if budget.left() < size["dag_reserve"]:
        for r in recipes:
            report.add(f"dag {r}", "dvc repro", status="SKIP", note=f"not started: {max(budget.left(), 0):.0f} s of "
                       f"the budget left, the DAGs take up to {size['dag_reserve']} s; `--parts dags` runs them alone")
        return
    with ThreadPoolExecutor(max(1, size["jobs"])) as pool:
        futures = [pool.submit(run_part, report, f"dag {r}", recipe_dag, report, r, work, built, size, base_url,
                               budget) for r in recipes]
        for f in futures:
            f.result()


# ---------------------------------------------------------------------------------------------------- the rows
GEMM_TFLOPS: dict = {}     # the card's bf16 GEMM rate, measured once per run
STEP_VARIANTS = (   # (row suffix, batch: "batch" or "latency_batch" of SIZES, compiled), in the order they run
    ("", "batch", False),                        # the step table of issue 32: every method, batch 128, eager
    (" batch {batch}", "latency_batch", False),  # the latency floor of a rank's step at a small per-rank batch
    (" compiled", "batch", True),                # the Trainer's `compile: true`, its warm-up counted
)


def steps(report: Report, shards: Path, params: dict, size: dict, budget: Budget, work: Path,
          variants=STEP_VARIANTS, eager: dict | None = None) -> None:
    """Every method's step, eager at `batch` and `latency_batch` and compiled at `batch`, with its share of the card's
    bf16 GEMM rate; a compiled row also gives its warm-up (compilation) and the steps after which it has paid for it.
    The figures go to `<out>/calibration.json` (benchmarks/calibration.py's schema with `batch`) and, on a GPU, into
    benchmarks/calibration.json. `eager`: {(method, batch): row} of the eager rows, filled here, read by compiled ones
    (a later call's)."""
    import torch

    from . import calibration, gpu
    from .fig2_methods import METHODS, shard_samples
    from .fig5_real import real_model_dir

    cuda = size["device"].startswith("cuda")
    peak = GEMM_TFLOPS.get("peak")
    if cuda and peak is None:
        peak = GEMM_TFLOPS["peak"] = gpu.gemm_tflops()
        report.add("steps", f"bf16 {gpu.GEMM_N}^3 GEMM", peak, "TFLOP/s", device=size["device"], status="info",
                   note=torch.cuda.get_device_name(0))
    model_dir = real_model_dir() if cuda else built_tiny_model(work)
    samples = shard_samples(shards) * size["batch"]       # a miniature tree: every wanted record, repeated
    eager, figures = {} if eager is None else eager, []
    for suffix, batch_key, compiled in variants:
        batch = size[batch_key]
        for name in METHODS:
            if compiled and (name, batch) not in eager:     # its eager twin first, in the same process
                step_row(report, name, "", batch, False, model_dir, params, size, budget, samples, peak, eager,
                         figures)
            step_row(report, name, suffix.format(batch=batch), batch, compiled, model_dir, params, size, budget,
                     samples, peak, eager, figures)
    if figures:
        command = "python -m benchmarks.acceptance" + ("" if cuda else " --tiny")
        found = gpu.step_figures(torch.cuda.get_device_name(0) if cuda else "cpu", figures, command)
        calibration.record(found, report.out / "calibration.json")
        if cuda:
            calibration.record(found)


def step_row(report: Report, name: str, suffix: str, batch: int, compiled: bool, model_dir: Path, params: dict,
             size: dict, budget: Budget, samples: list, peak: float | None, eager: dict, figures: list) -> None:
    import torch

    from . import gpu

    cuda = size["device"].startswith("cuda")
    row_name = f"step {name}{suffix}"
    if budget.left() < size["step_reserve"]:
        report.add("steps", row_name, status="SKIP", note=f"not started: {max(budget.left(), 0):.0f} s of the "
                   f"budget left, a row may take {size['step_reserve']} s; `--parts "
                   f"{'compiled' if compiled else 'steps'}` runs it alone")
        return
    row = run_part(report, f"steps {row_name}", gpu.method_step, name, model_dir, params,
                   lambda m: print(m, file=sys.stderr, flush=True), device=size["device"], batch=batch,
                   precision=size["precision"], warmup=size["warmup"], steps=size["steps"],
                   samples=samples, compile_model=compiled, backend=size["backend"])
    if cuda:
        torch.cuda.empty_cache()
    if not row:
        return
    row["arch"] = size["arch"] or "ViT-B-16"
    figures.append(row)
    share = f", {row['tflops'] / peak:.0%} of the GEMM's rate" if peak else ""
    note = f"{row['samples_per_s']:.0f} samples/s, {row['tflops']:.2f} TFLOP/s{share}"
    if compiled and (name, batch) in eager:
        base = eager[(name, batch)]
        pays = gpu.compile_pays_after(base, row)
        note += (f"; eager {base['ms_per_step']:.1f} ms ({base['ms_per_step'] / row['ms_per_step']:.2f}x); "
                 f"warm-up {row['warmup_s']:.1f} s (eager {base['warmup_s']:.1f} s): "
                 + (f"pays after {pays:.0f} steps" if pays != float("inf") else "never pays (no faster)"))
    elif not compiled:
        eager[(name, batch)] = row
    report.add("steps", row_name, row["ms_per_step"], "ms", device=row["device"],
               peak_gb=row["peak_gb"] if cuda else None, status=gpu_status(size["device"], row["peak_gb"]),
               note=note + f" (batch {batch}, {size['precision']}" + (f", {size['backend']}" if compiled else "")
               + ")", **{k: v for k, v in row.items() if k not in ("method", "device", "peak_gb")})


def built_tiny_model(work: Path) -> Path:
    from clipfinetune.models import export_model, load_model

    folder = work / "model_tiny"
    if not (folder / "open_clip_config.json").is_file():
        export_model(load_model("cft-tiny-vit"), folder)
    return folder


def rows(report: Report, size: dict, budget: Budget, work: Path) -> None:
    """`gpu.extra_rows`, one at a time (each catches its own error), at gpu.SIZES' size for the device."""
    from . import gpu
    from .fig5_real import real_model_dir

    cuda = size["device"].startswith("cuda")
    sizes = gpu.SIZES["gpu" if cuda else "tiny"]
    device, precision = ("cuda", "bf16") if cuda else ("cpu", "fp32")
    model_dir = real_model_dir() if cuda else built_tiny_model(work)
    work = work / "rows"
    shutil.rmtree(work, ignore_errors=True)
    samples, shards, paths = gpu.row_inputs(work, sizes)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    def e2e(r):
        return (r["ours_samples_per_s"], "samples/s",
                f"open_clip_train {r['open_clip_train_samples_per_s']:.0f} samples/s: {r['ratio']:.2f}x (goal >= 1.0x)")

    def loader(r):
        note = f"the step consumes {r['step_samples_per_s']:.0f}: {r['ratio']:.2f}x (goal >= 1.1x), "
        return r["loader_samples_per_s"], "samples/s", note + f"{r['workers']} workers"

    table = [
        ("end to end vs open_clip_train", lambda: gpu.end_to_end(model_dir, shards, sizes, device, precision, log),
         e2e),
        ("loader vs step", lambda: gpu.loader_vs_step(model_dir, shards, sizes, device, precision, log), loader),
        ("eval images", lambda: gpu.eval_images_per_s(model_dir, paths, sizes, device, log),
         lambda r: (r["images_per_s"], "images/s", f"{r['images']} images")),
        ("SAM vit_b", lambda: gpu.sam_seconds(sizes, device, log),
         lambda r: (r["median_seconds_per_image"], "s/image", f"{r['image_size']} px, {r['points_per_side']}^2 pts")),
        ("LISM", lambda: gpu.lism_crops_per_s(model_dir, samples, work, sizes, device, log),
         lambda r: (r["crops_per_s"], "crops/s", f"{r['images']} images, {r['workers']} workers")),
    ]
    import torch

    for name, measure, describe in table:
        if budget.left() < 30:
            report.add("rows", name, status="SKIP", note="time budget spent")
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with GpuMemory() as mem:
            result = run_part(report, f"rows {name}", measure)
        if result is None:
            continue
        value, unit, note = describe(result)
        peak = max(mem.peak_gb, torch.cuda.max_memory_allocated() / 1e9) if cuda else None
        report.add("rows", name, value, unit, device=device, peak_gb=peak,
                   status=gpu_status(device, peak) if cuda else "PASS", note=note, result=result)


# ----------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.acceptance", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU rehearsal's sizes (the default without CUDA)")
    ap.add_argument("--out", default=str(WORK / "acceptance" / "out"), help="folder for acceptance.md, rows.jsonl")
    ap.add_argument("--work", default=str(WORK / "acceptance"), help="scratch folder (replaced parts each run)")
    ap.add_argument("--budget", type=float, help="seconds for the whole run (default: 480 on a GPU, 3600 tiny)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipes whose DAG runs")
    ap.add_argument("--jobs", type=int, help="recipe DAGs run side by side (default: 5 on a GPU, 2 tiny)")
    ap.add_argument("--parts", help="comma-separated parts to run, of " + ", ".join(PARTS) + " (default: all but "
                    "compiled on a GPU, its second command; all at the tiny size); the miniature tree and its base DAG "
                    "run for any but rows")
    a = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    size = dict(SIZES["tiny" if a.tiny or not cuda else "gpu"])
    size["jobs"] = a.jobs or size["jobs"]
    budget = Budget(a.budget or size["budget"])
    HOST_COUNTS.update(host_counts(size))
    device = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    title = (f"GPU acceptance on {device}" if size["device"].startswith("cuda") else
             f"CPU rehearsal at the tiny size ({device}: NOT a GPU measurement)") + \
        f", {datetime.datetime.now().isoformat(timespec='minutes')}, torch {torch.__version__}"
    report = Report(Path(a.out), title)
    t_start = time.perf_counter()
    report.add("env", "device", device, status="info" if cuda else "CPU", device=size["device"],
               note="" if cuda else "no CUDA: every row below is the CPU rehearsal")
    for part, needed in NEEDS.items():
        lacking = missing(part)
        report.add("env", f"packages for {part}", len(needed) - len(lacking), f"of {len(needed)}",
                   status="FAIL" if lacking else "PASS", note=f"missing {lacking}" if lacking else "")
    work = Path(a.work).resolve()
    recipes = [r for r in a.recipes.split(",") if r]
    parts = set((a.parts or size["parts"]).split(","))
    if parts - set(PARTS):
        raise SystemExit(f"--parts: unknown {sorted(parts - set(PARTS))}; the parts are {', '.join(PARTS)}")
    built, base_params, shards = None, None, None
    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures import real_tree
    from fixtures.llm import openai_server, rewrite_reply

    eager_steps: dict = {}
    with openai_server(rewrite_reply(real_tree.NOUNS, real_tree.ADJECTIVES)) as (base_url, _):
        if not missing("dag") and parts & {"steps", "compiled", "dags"}:
            archs = set()
            if not size["arch"]:
                from clipfinetune.project.profile import load
                archs = {(load(ROOT / "params.real.yaml").get("model") or {}).get("name", "ViT-B-16")} | {
                    (load(ROOT / "recipes" / f"{r}.yaml").get("model") or {}).get("name", "ViT-B-16") for r in recipes}
            built = run_part(report, "dag setup", build_datasets, work / "tree", size, archs)
            if built:
                base = work / "base"
                if "dags" in parts:       # DAGs that run their stages, not an earlier run's; `compiled` alone reuses
                    shutil.rmtree(work / "dvc-cache", ignore_errors=True)
                base_params = run_part(report, "dag base", make_project, base, work / "tree" / "datasets",
                                       ["params.real.yaml"], size, built, base_url)
                if base_params and run_part(report, "dag base", dag, report, "dag base", base, ["shards"], size,
                                            budget):
                    shards = base / "data" / "shards"
        if parts & {"steps", "compiled"}:
            if shards is None and any((ROOT / "data" / "shards").glob("train-*.tar")):
                from .common import load_params
                shards, base_params = ROOT / "data" / "shards", load_params()
                report.add("steps", "batches from", str(shards), note="the miniature DAG did not run: the sample "
                           "shards")
            if shards is None:
                report.add("steps", "every method's step", status="SKIP", note="no shards: the base DAG did not run "
                           "and data/shards holds none")
        # eager steps and rows first, then the recipes' DAGs, then the compiled steps (the longest to warm up)
        if shards is not None and "steps" in parts and not missing("steps"):
            run_part(report, "steps", steps, report, shards, base_params, size, budget, work,
                     [v for v in STEP_VARIANTS if not v[2]], eager_steps)
        if "rows" in parts and not missing("rows"):
            run_part(report, "rows", rows, report, size, budget, work)
        if "dags" in parts and not missing("dag") and built:
            recipe_dags(report, recipes, work, built, size, base_url, budget)
        if shards is not None and "compiled" in parts and not missing("steps"):
            run_part(report, "steps", steps, report, shards, base_params, size, budget, work,
                     [v for v in STEP_VARIANTS if v[2]], eager_steps)
    report.add("total", "wall time", round(time.perf_counter() - t_start, 1), "s",
               status="FAIL" if budget.left() < 0 else "PASS",
               note=f"budget {a.budget or size['budget']:.0f} s" + ("" if budget.left() >= 0 else ", exceeded"))
    print(report.table())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
