"""Resume of the item stages (issue 32): segments and lism SIGKILLed after their first part file was written resume
from their parts (data/cache/<stage>/<fingerprint>/) and end byte-identical to an uninterrupted run; a finished run
leaves no parts behind. eval@base's case (~40 s) and the stale-parts case run in tests/scale/test_item_stages.py
with the same helpers."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from .conftest import OUTPUTS, Project, kill, run_stage, start_stage

pytestmark = pytest.mark.faults

INPUTS = {
    "segments": ["data/sample"],
    "lism": ["data/sample", "models/base", "data/prepared/sentences.parquet", "data/prepared/segments.parquet"],
    "eval@base": ["data/sample", "models/base", "data/prepared/global_local"],
}
FAULT_SUITE = ["segments", "lism"]        # cheap here (~10-16 s each); eval@base in tests/scale/
EVAL_OUTPUTS = ["metrics/base.json", "metrics/items/base.parquet"]
RESUMED = re.compile(r"resuming, (\d+) of this rank's (\d+) units already done")


def part_files(proj: Project, stage: str) -> list[Path]:
    d = proj / "data/cache" / stage.replace("@", "-")
    return sorted(p for p in d.rglob("unit-*") if p.is_file()) if d.is_dir() else []


def outputs(proj: Project, stage: str) -> dict[str, bytes]:
    if stage.startswith("eval@"):
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
def test_killed_item_stage_resumes_from_its_parts_byte_identical(tiny_project, tmp_path, stage):
    check_kill_and_resume(tiny_project, tmp_path, stage)


def check_kill_and_resume(tiny_project: Project, tmp_path: Path, stage: str) -> None:
    proj = tiny_project.clone(tmp_path / "proj", INPUTS[stage])
    if stage.startswith("eval@"):        # the tiny project has no eval: its uninterrupted run is the reference
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
    rerun = run_stage(proj.root, stage)
    resumed = RESUMED.search(rerun.stdout + rerun.stderr)
    assert resumed and int(resumed.group(1)) >= len(written), "the re-run did not resume from the parts"
    assert outputs(proj, stage) == ref
    assert not part_files(proj, stage)


assert set(INPUTS) - {"eval@base"} <= set(OUTPUTS)
