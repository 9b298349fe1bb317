"""`make test`'s grouping through pytest-xdist's public `--dist loadgroup`: tests/conftest.py gives every test an
`xdist_group` (tests/faults/ one group, any other module its own), so a module or session fixture that runs pipeline
stages is built on one worker only. With pytest >= 9.2 and pytest-xdist <= 3.8 the groups silently stop taking
effect (pyproject.toml pins pytest below 9.2): this test fails when they do."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

MODULE = '''
import json, os, pytest

pytestmark = [getattr(pytest.mark, m) for m in {marks!r}]

@pytest.mark.parametrize("i", range({n}))
def test_records_its_worker(i):
    with open("workers.jsonl", "a") as f:
        f.write(json.dumps([__name__, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
'''


def test_each_module_and_the_faults_folder_run_on_one_worker_the_heavy_groups_first(tmp_path):
    """Three unit modules of 4 tests, a `dag` module and tests/faults/ (2 modules) of 2 tests each: xdist's default
    order (larger groups first) would start both workers on unit modules."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    for name in ("test_one", "test_two", "test_three"):
        (tmp_path / f"{name}.py").write_text(MODULE.format(marks=[], n=4))
    (tmp_path / "test_zdag.py").write_text(MODULE.format(marks=["dag"], n=2))
    (tmp_path / "faults").mkdir()
    for name in ("test_faults_a", "test_faults_b"):
        (tmp_path / "faults" / f"{name}.py").write_text(MODULE.format(marks=["faults"], n=1))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "--rootdir", str(tmp_path),
                           "-c", "/dev/null", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [json.loads(line) for line in (tmp_path / "workers.jsonl").read_text().splitlines()]
    assert len(runs) == 16
    group = lambda module: "faults" if module.startswith("test_faults_") else module
    workers: dict[str, set] = {}
    for module, worker in runs:
        workers.setdefault(group(module), set()).add(worker)
    assert sorted(workers) == ["faults", "test_one", "test_three", "test_two", "test_zdag"]
    assert all(len(w) == 1 for w in workers.values()), \
        f"groups split over workers {workers}: pytest {pytest.__version__} (pyproject.toml wants < 9.2: reinstall " \
        "the dev dependencies, `make setup`)"
    first = {}
    for module, worker in runs:
        first.setdefault(worker, group(module))
    assert sorted(first.values()) == ["faults", "test_zdag"]          # each worker began with a heavy group
