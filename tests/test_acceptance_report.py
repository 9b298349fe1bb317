"""The GPU acceptance run's bookkeeping (benchmarks/acceptance.py), without running it: a row meant for a GPU that
left the GPU's memory untouched is flagged, not passed; rows reach the disk as they come (a lease can end mid-run);
a part's exception becomes an ERROR row and the run goes on; the recipes' training is shrunk at every level.
The run itself (CPU, tiny size) is tests/scale/test_acceptance.py."""
from __future__ import annotations

import json

from benchmarks import acceptance


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
    train = {"epochs": 5, "batch_size": 256, "lr": 5e-6, "workers": 8, "clip": {},
             "goal": {"epochs": 10, "batch_size": 16, "seed": 1337}, "fsc_clip": {"epoch_samples": 100000}}
    acceptance.shrink_train(train)
    assert train == {"epochs": 1, "batch_size": 2, "lr": 5e-6, "workers": 0, "clip": {},
                     "goal": {"epochs": 1, "batch_size": 2, "seed": 1337}, "fsc_clip": {"epoch_samples": 0}}


def test_a_missing_package_is_named_per_part(monkeypatch):
    monkeypatch.setitem(acceptance.NEEDS, "steps", ["json", "no_such_module_here"])
    assert acceptance.missing("steps") == ["no_such_module_here"]
