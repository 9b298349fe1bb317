"""Resume of the item stages (issue 32): segments and lism SIGKILLed after their first part file was written resume
from their parts (data/cache/<stage>/<fingerprint>/) and end byte-identical to an uninterrupted run; a finished run
leaves no parts behind. eval_base's case (~40 s) and the stale-parts case run in tests/scale/test_item_stages.py
with the same helpers."""
from __future__ import annotations

import logging
import re
import time
from pathlib import Path

import pytest
import torch

from .conftest import ENV, OUTPUTS, Project, dvc_name, kill, run_stage, start_stage

pytestmark = pytest.mark.faults

INPUTS = {
    "segments": ["data/sample"],
    "lism": ["data/sample", "models/base", "data/prepared/sentences.parquet", "data/prepared/segments.parquet"],
    "eval_base": ["data/sample", "models/base", "data/evalsets/global_local"],
}
FAULT_SUITE = ["segments", "lism"]        # cheap here (~10-16 s each); eval_base in tests/scale/
EVAL_OUTPUTS = ["metrics/base.json", "metrics/items/base.parquet"]
RESUMED = re.compile(r"resuming, (\d+) of this rank's (\d+) units already done")


def part_files(proj: Project, stage: str) -> list[Path]:
    d = proj / "data/cache" / dvc_name(stage).replace("@", "-")
    return sorted(p for p in d.rglob("unit-*") if p.is_file()) if d.is_dir() else []


def outputs(proj: Project, stage: str) -> dict[str, bytes]:
    if stage.startswith("eval"):
        return {rel: (proj / rel).read_bytes() for rel in EVAL_OUTPUTS if (proj / rel).is_file()}
    return proj.snapshot(stage)


def kill_after_first_part(proj: Project, stage: str) -> None:
    proc = start_stage(proj.root, stage)
    t0 = time.perf_counter()
    while proc.poll() is None and not part_files(proj, stage) and time.perf_counter() - t0 < 120:
        time.sleep(0.001)
    finished = proc.poll() is not None
    kill(proc)
    assert not finished, f"{stage} ended before it was killed (output: {proc.stdout.read()[-2000:]})"


@pytest.mark.parametrize("stage", FAULT_SUITE)
def test_killed_item_stage_resumes_from_its_parts_byte_identical(tiny_project, tmp_path, stage, inprocess, caplog):
    def rerun_inprocess(proj: Project) -> str:       # imports already warm: seconds cheaper than a subprocess
        caplog.set_level(logging.INFO)
        threads = torch.get_num_threads()
        torch.set_num_threads(int(ENV["OMP_NUM_THREADS"]))   # the killed run's count (parts are keyed by it)
        try:
            inprocess(proj, stage)
        finally:
            torch.set_num_threads(threads)
        return caplog.text

    check_kill_and_resume(tiny_project, tmp_path, stage, rerun_inprocess)


def rerun_subprocess(proj: Project, stage: str) -> str:
    proc = run_stage(proj.root, stage)
    return proc.stdout + proc.stderr


def check_kill_and_resume(tiny_project: Project, tmp_path: Path, stage: str, rerun=None) -> None:
    """Kill `stage` after its first part, re-run it (`rerun(project)` -> its log text; default a subprocess) and
    check that it resumed and wrote the uninterrupted run's bytes, leaving no parts."""
    proj = tiny_project.clone(tmp_path / "proj", INPUTS[stage])
    if stage.startswith("eval"):        # the tiny project has no eval: its uninterrupted run is the reference
        run_stage(proj.root, stage)
        ref = outputs(proj, stage)
        for rel in EVAL_OUTPUTS:
            (proj / rel).unlink()
    else:
        ref = tiny_project.snapshot(stage)
    assert ref and not part_files(proj, stage), "an uninterrupted run leaves no parts"
    kill_after_first_part(proj, stage)
    written = part_files(proj, stage)
    assert written and not outputs(proj, stage), "killed after its first part: parts, no outputs yet"
    log_text = rerun(proj) if rerun else rerun_subprocess(proj, stage)
    resumed = RESUMED.search(log_text)
    assert resumed and int(resumed.group(1)) >= len(written), "the re-run did not resume from the parts"
    assert outputs(proj, stage) == ref
    assert not part_files(proj, stage)


assert set(INPUTS) - {"eval_base"} <= set(OUTPUTS)
