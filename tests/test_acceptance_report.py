"""The GPU acceptance run's bookkeeping (benchmarks/acceptance.py), without running it: a row meant for a GPU that
left the GPU's memory untouched is flagged, not passed; rows reach the disk as they come (a run stopped mid-way
keeps them); a part's exception becomes an ERROR row and the run goes on; the recipes' training is shrunk at every
level; every child process (benchmarks.common.run's, and a stage under the acceptance's `dvc repro`) imports what
only the parent's PYTHONPATH reaches (a GPU machine's packages installed with `pip install --target`).
The run itself (CPU, tiny size) is tests/scale/test_acceptance.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import acceptance, common


def test_gpu_work_that_left_the_gpu_memory_untouched_is_flagged_as_cpu():
    assert acceptance.gpu_status("cuda:0", 12.0) == "PASS"
    assert acceptance.gpu_status("cuda:0", 0.03) == "CPU!"        # 0.03 GB: nothing ran there
    assert acceptance.gpu_status("cuda", None) == "CPU!"
    assert acceptance.gpu_status("cpu", 0.0) == "PASS"             # the CPU rehearsal measures no GPU memory
    assert acceptance.gpu_status("cuda:0", 12.0, ok=False) == "FAIL"


def test_rows_reach_the_disk_one_by_one_and_a_failing_part_is_a_row_not_the_end(tmp_path):
    report = acceptance.Report(tmp_path, "title")
    report.add("steps", "step clip", 92.8, "ms", device="cuda:0", peak_gb=15.8, status="PASS")
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["row"] for line in lines] == ["step clip"]
    assert "| steps | step clip | 92.80 | ms | cuda:0 | 15.80 | PASS |" in (tmp_path / "acceptance.md").read_text()
    assert not report.failed

    def broken():
        raise RuntimeError("first line\nthe reason")

    assert acceptance.run_part(report, "rows", broken) is None
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["part"], r["status"]) for r in rows] == [("steps", "PASS"), ("rows", "ERROR")]
    assert rows[1]["note"] == "RuntimeError: the reason"
    assert report.failed
    assert acceptance.run_part(report, "rows", lambda x, y=0: x + y, 1, y=2) == 3


def test_every_training_setting_of_a_recipe_is_shrunk_whatever_its_level():
    train = {"epochs": 5, "batch_size": 256, "lr": 5e-6, "clip": {},
             "goal": {"epochs": 10, "batch_size": 16, "seed": 1337}, "fsc_clip": {"epoch_samples": 100000}}
    acceptance.shrink_train(train)
    assert train == {"epochs": 1, "batch_size": 2, "lr": 5e-6, "clip": {},
                     "goal": {"epochs": 1, "batch_size": 2, "seed": 1337}, "fsc_clip": {"epoch_samples": 0}}


def test_a_missing_package_is_named_per_part(monkeypatch):
    monkeypatch.setitem(acceptance.NEEDS, "steps", ["json", "no_such_module_here"])
    assert acceptance.missing("steps") == ["no_such_module_here"]


def only_on_pythonpath(tmp_path, monkeypatch) -> str:
    """A module this process reaches only through PYTHONPATH (as a package installed with `pip install --target`
    into a folder on PYTHONPATH), and that folder set in this process's environment. Returns the module's name."""
    folder = tmp_path / "site-1"
    folder.mkdir()
    (folder / "only_on_pythonpath.py").write_text("WHERE = __file__\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]))
    return "only_on_pythonpath"


def test_a_benchmark_child_imports_what_only_the_parents_pythonpath_reaches(tmp_path, monkeypatch):
    name = only_on_pythonpath(tmp_path, monkeypatch)
    bare = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    missing = subprocess.run([sys.executable, "-c", f"import {name}"], env=bare, capture_output=True, check=False)
    assert missing.returncode != 0                      # without the parent's PYTHONPATH the child cannot import it
    # the end-to-end trainer and open_clip_train run through common.run
    rc, out, _ = common.run([sys.executable, "-c", f"import {name}, clipfinetune; print({name}.WHERE)"], timeout=120)
    assert rc == 0, out
    assert out.strip().splitlines()[-1] == str(tmp_path / "site-1" / f"{name}.py")
    assert common.child_env()["PYTHONPATH"].split(os.pathsep)[:2] == [str(common.ROOT), str(tmp_path / "site-1")]


def test_a_stage_under_the_acceptance_dvc_repro_imports_what_only_the_parents_pythonpath_reaches(tmp_path,
                                                                                                 monkeypatch):
    name = only_on_pythonpath(tmp_path, monkeypatch)
    project = tmp_path / "work" / "project"
    project.mkdir(parents=True)
    (project / ".dvc").mkdir()
    (project / ".dvc" / "config").write_text("[core]\n    no_scm = true\n")
    (project / "dvc.yaml").write_text(
        "stages:\n  probe:\n    cmd: python -c \"import " + name + ", clipfinetune; open('where.txt', 'w')"
        ".write(" + name + ".WHERE)\"\n    outs:\n      - where.txt\n")
    rc, out, lines = acceptance.run_cmd(project, [sys.executable, "-m", "dvc", "repro"], timeout=300)
    assert rc == 0, out
    assert (project / "where.txt").read_text() == str(tmp_path / "site-1" / f"{name}.py")
    assert acceptance.stage_seconds(lines, 1e9).keys() == {"probe"}
