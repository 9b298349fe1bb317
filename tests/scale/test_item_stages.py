"""Item stages (segments, lism, eval) under torchrun (issue 32): as 2 gloo ranks on the fault suite's tiny project
their outputs are byte-identical to one process's; LISM's test list too when both ranks write test items;
eval_base's kill-and-resume case and the stale-parts case of tests/faults/test_faults_resume.py (too slow for
`make test`). Minutes: tests/scale/ only."""
from __future__ import annotations

import json
import re
import subprocess

import pytest
from faults.conftest import ENV, PY, Project, run_stage, stage_cmd, tiny_project  # noqa: F401  (the session fixture)
from faults.test_faults_resume import (
    EVAL_OUTPUTS,
    INPUTS,
    check_kill_and_resume,
    kill_after_first_part,
    outputs,
    part_files,
)


def run_ranks(proj: Project, stage: str, nproc: int = 2) -> str:
    script_and_args = stage_cmd(stage)[1:]           # stages/<name>.py [--model M] --stage <stage>
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *script_and_args]
    proc = subprocess.run(cmd, cwd=proj.root, env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{stage} as {nproc} ranks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("stage", list(INPUTS))
def test_two_gloo_ranks_write_what_one_process_writes(tiny_project, tmp_path, stage):  # noqa: F811
    proj = tiny_project.clone(tmp_path / "proj", INPUTS[stage])
    if stage.startswith("eval"):
        run_stage(proj.root, stage)
        one = outputs(proj, stage)
        for rel in EVAL_OUTPUTS:
            (proj / rel).unlink()
    else:
        one = tiny_project.snapshot(stage)
    run_ranks(proj, stage)
    assert outputs(proj, stage) == one
    assert not part_files(proj, stage)


def test_lism_test_list_written_by_both_ranks_is_what_one_process_writes(tiny_project, tmp_path):  # noqa: F811
    """GOAL's test list is written inside LISM's work units: with test images in every unit (every other DOCCI
    training record relabelled `test` in the copy), both ranks write test items, and the outputs (test list, its
    images and crops included) are byte-identical to one process's."""
    proj = tiny_project.clone(tmp_path / "proj", INPUTS["lism"])
    descriptions = proj / proj.params()["sources"]["docci"]["descriptions"]
    lines = [json.loads(line) for line in descriptions.read_text().splitlines() if line.strip()]
    train = [rec for rec in lines if rec["split"] == "train"]
    for rec in train[::2]:
        rec["split"] = "test"
    descriptions.write_text("".join(json.dumps(rec) + "\n" for rec in lines))
    run_stage(proj.root, "lism")
    one = outputs(proj, "lism")
    listed = json.loads(one["data/evalsets/global_local/test.json"])
    assert len(listed) == 2 * sum(rec["split"] == "test" for rec in lines)
    for rel in list(one):
        path = proj / rel
        path.unlink()
    log = run_ranks(proj, "lism")
    wrote = {int(r): int(n) for r, n in re.findall(r"rank (\d+) matched \d+ images \(\d+ candidates\) and wrote (\d+)",
                                                  log)}
    assert set(wrote) == {0, 1} and min(wrote.values()) > 0 and sum(wrote.values()) == len(listed) // 2, log[-3000:]
    assert outputs(proj, "lism") == one
    assert not part_files(proj, "lism")


def test_killed_eval_resumes_from_its_parts_byte_identical(tiny_project, tmp_path):  # noqa: F811
    check_kill_and_resume(tiny_project, tmp_path, "eval_base")


def test_parts_of_another_fingerprint_are_never_used(tiny_project, tmp_path):  # noqa: F811
    """A stale part (another fingerprint: here a forged one with wrong rows) is deleted, not merged."""
    proj = tiny_project.clone(tmp_path / "proj", INPUTS["segments"])
    kill_after_first_part(proj, "segments")
    (part,) = part_files(proj, "segments")[:1]
    stale = part.parent.with_name("0" * 24) / part.name
    stale.parent.mkdir()
    stale.write_text(part.read_text().replace('"rows": [[', '"rows": [["forged", 0, 0, 0, 1, 1, 0.5], ['))
    part.unlink()
    rerun = run_stage(proj.root, "segments")
    assert "deleted the parts of other runs" in rerun.stdout + rerun.stderr
    assert proj.snapshot("segments") == tiny_project.snapshot("segments")
    assert not stale.parent.exists()

