"""The GPU acceptance command's CPU rehearsal: `python -m benchmarks.acceptance --tiny`, the command a GPU machine
runs first, at the tiny size on the CPU, and as a GPU machine without a package index runs it: the interpreter
without the virtualenv, every package reachable only through PYTHONPATH (there: folders filled by
`pip install --target`; here: the virtualenv's site-packages), so every child process (the end-to-end trainer,
open_clip_train, `dvc repro` and its stages) must be handed the parent's PYTHONPATH. Every part runs and passes: every
method's step eager at two batches and compiled (its losses and the calibration figures), every row of
`benchmarks --gpu` (end to end, loader, eval, SAM, LISM), the miniature real profile's `dvc repro shards`, and each
recipe's whole DAG with one metrics file per run; the table says it is no GPU measurement. Not timed. Tens of minutes
on 2 cores (five recipe DAGs, SAM vit_b's encoder on the CPU): tests/scale/ only, `make acceptance-tiny` alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from benchmarks.acceptance import RECIPES
from benchmarks.fig2_methods import METHODS

ROOT = Path(__file__).resolve().parents[2]


def pythonpath_only() -> tuple[str, dict]:
    """(the virtualenv's base interpreter, an environment where the virtualenv's packages and this checkout are
    reachable only through PYTHONPATH, its bin folder off PATH)."""
    if sys.prefix == sys.base_prefix:
        pytest.skip("not in a virtualenv: no base interpreter to run without it")
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env["PYTHONNOUSERSITE"] = "1"
    bare = subprocess.run([str(base), "-c", "import open_clip"], env={**env, "PYTHONPATH": ""}, capture_output=True,
                          check=False)
    assert bare.returncode != 0, "the base interpreter finds open_clip by itself: the test would prove nothing"
    site = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *site])
    return str(base), env


def test_the_acceptance_command_passes_on_the_cpu_at_tiny_size_with_its_packages_on_pythonpath_only(tmp_path):
    out = tmp_path / "out"
    python, env = pythonpath_only()
    proc = subprocess.run([python, "-m", "benchmarks.acceptance", "--tiny", "--out", str(out), "--work",
                           str(tmp_path / "work")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600,
                          check=False)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    status = {(r["part"], r["row"]): r["status"] for r in rows}
    assert not [r for r in rows if r["status"] in ("FAIL", "ERROR", "CPU!", "SKIP")], rows
    assert status[("dag base", "dvc repro shards")] == "PASS"
    for method in METHODS:
        for row in (f"step {method}", f"step {method} batch 2", f"step {method} compiled"):
            assert status[("steps", row)] == "PASS", row
    compiled = {r["row"]: r for r in rows if r["row"].endswith(" compiled")}
    assert all(r["details"]["compiled"] and r["details"]["warmup_s"] > 0 for r in compiled.values())
    figures = json.loads((out / "calibration.json").read_text())["figures"]
    assert {(f["what"], f["method"], f["batch"]) for f in figures} == {
        (what, m, batch) for m in METHODS for what, batch in (("train_step", 4), ("train_step", 2),
                                                               ("train_step_compiled", 4))}
    assert all(f["device"] == "cpu" and f["value"] > 0 and f["unit"] == "samples/s" for f in figures)
    for row in ("end to end vs open_clip_train", "loader vs step", "eval images", "SAM vit_b", "LISM"):
        assert status[("rows", row)] == "PASS", row
    for recipe in RECIPES:
        assert status[(f"dag {recipe}", "dvc repro")] == "PASS", recipe
        assert status[(f"dag {recipe}", "metrics per run")] == "PASS", recipe
    dags = [r for r in rows if r["part"].startswith("dag") and r["row"].startswith("dvc repro")]
    assert all(set(r["details"]["devices"].values()) == {"cpu"} and r["details"]["ran"] for r in dags)
    table = (out / "acceptance.md").read_text()
    assert "NOT a GPU measurement" in table.splitlines()[0] and table.strip() in proc.stdout
