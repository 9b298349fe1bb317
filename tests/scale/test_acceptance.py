"""The GPU acceptance command's CPU rehearsal: `python -m benchmarks.acceptance --tiny`, the command a GPU lease runs,
at the tiny size on this machine's CPU. Every part runs and passes: the step of every method, every row of
`benchmarks --gpu` (end to end, loader, eval, SAM, LISM), the miniature real profile's `dvc repro shards`, and each
recipe's whole DAG with one metrics file per run; the table says it is no GPU measurement. Not timed. Tens of minutes
on 2 cores (five recipe DAGs, SAM vit_b's encoder on the CPU): tests/scale/ only, `make acceptance-tiny` alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.acceptance import RECIPES
from benchmarks.fig2_methods import METHODS

ROOT = Path(__file__).resolve().parents[2]


def test_the_acceptance_command_passes_on_the_cpu_at_tiny_size(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.acceptance", "--tiny", "--out", str(out), "--work",
                           str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          check=False)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    status = {(r["part"], r["row"]): r["status"] for r in rows}
    assert not [r for r in rows if r["status"] in ("FAIL", "ERROR", "CPU!", "SKIP")], rows
    assert status[("dag base", "dvc repro shards")] == "PASS"
    for method in METHODS:
        assert status[("steps", f"step {method}")] == "PASS", method
    for row in ("end to end vs open_clip_train", "loader vs step", "eval images", "SAM vit_b", "LISM"):
        assert status[("rows", row)] == "PASS", row
    for recipe in RECIPES:
        assert status[(f"dag {recipe}", "dvc repro")] == "PASS", recipe
        assert status[(f"dag {recipe}", "metrics per run")] == "PASS", recipe
    dags = [r for r in rows if r["part"].startswith("dag") and r["row"].startswith("dvc repro")]
    assert all(set(r["details"]["devices"].values()) == {"cpu"} and r["details"]["ran"] for r in dags)
    table = (out / "acceptance.md").read_text()
    assert "NOT a GPU measurement" in table.splitlines()[0] and table.strip() in proc.stdout
