"""Interruption: every data stage SIGKILLed at random points, then re-run, ends byte-identical to an
uninterrupted run, and a killed run never leaves a final output that is not the finished one.

Issue 26: the kills and the re-run happen with every core kept busy by spinning processes (the normal case on a
shared node, and where timing-dependent bugs show), and the re-run uses another torch thread count than the
reference runs (which ran with OMP_NUM_THREADS=1, conftest.ENV)."""
from __future__ import annotations

import random
import time

import pytest
import torch

from .conftest import ENV, OUTPUTS, Project, busy_cores, kill, start_stage

pytestmark = pytest.mark.faults

# what each stage reads (copied from the tiny project; its own outputs are never copied)
INPUTS = {
    "sample": [],
    "word_regions": ["data/sample"],
    "sentences": ["data/sample"],
    "segments": ["data/sample"],
    "negatives": ["data/sample"],
    "lism": ["data/sample", "models/base", "data/prepared/sentences.parquet", "data/prepared/segments.parquet"],
    "shards": ["data/sample", "data/prepared/word_regions.parquet", "data/prepared/sentences.parquet",
               "data/prepared/local_pairs.parquet", "data/prepared/negatives.parquet"],
}
# the kills each stage gets, in order, on the same copy: "write" = a random few ms after its first atomic write
# began (the dangerous moment), "early" = a uniform random delay over the stage's reference duration (for
# negatives: a half-filled answer cache). The re-run after the kills runs in-process (imports already warm).
KILLS = {"sample": ("write", "early", "write"), "word_regions": ("write",), "sentences": ("write",),
         "segments": ("write",), "negatives": ("early", "write"), "lism": ("write",),
         "shards": ("write", "early", "write")}
RERUN_THREADS = 2     # != the reference runs' count
assert ENV["OMP_NUM_THREADS"] == "1"


def temp_siblings(proj: Project, stage: str) -> list[str]:
    """Temporary files/folders of atomic writes next to the stage's outputs."""
    parents = {(proj / rel).parent for rel in OUTPUTS[stage]}
    return sorted(p.name for d in parents if d.is_dir() for p in d.iterdir() if p.name.startswith(".tmp-"))


def kill_at_random(proj: Project, stage: str, rng: random.Random, horizon: float, when_writing: bool) -> str:
    """Start the stage and SIGKILL it: after a uniform delay in [0, horizon), or (when_writing) a random few
    milliseconds after its first atomic write began. Returns where it was killed (for the failure message)."""
    proc = start_stage(proj.root, stage)
    t0 = time.perf_counter()
    if when_writing:
        delay = rng.uniform(0, 0.05)
        while proc.poll() is None and not temp_siblings(proj, stage) and time.perf_counter() - t0 < 120:
            time.sleep(0.001)
        time.sleep(delay)
        where = f"{delay * 1000:.0f} ms into the first atomic write"
    else:
        delay = rng.uniform(0, horizon)
        while proc.poll() is None and time.perf_counter() - t0 < delay:
            time.sleep(0.005)
        where = f"{delay:.2f} s after start"
    finished = proc.poll() is not None
    kill(proc)
    return where + (" (the stage had already finished)" if finished else "")


def assert_no_unfinished_output(proj: Project, ref: dict[str, bytes], stage: str, where: str) -> None:
    got = proj.snapshot(stage)
    for rel, data in got.items():
        assert rel in ref, f"{stage} killed {where}: left {rel}, which a finished run does not write"
        assert data == ref[rel], f"{stage} killed {where}: {rel} exists but is not the finished output"


@pytest.mark.parametrize("stage", list(INPUTS))
def test_killed_stage_rerun_is_byte_identical(tiny_project, tmp_path, stage, inprocess):
    ref = tiny_project.snapshot(stage)
    assert ref, f"the reference run of {stage} wrote nothing"
    proj = tiny_project.clone(tmp_path / "proj", INPUTS[stage])
    horizon = max(1.0, tiny_project.durations[stage])
    threads = torch.get_num_threads()
    with busy_cores(seconds=240):
        for seed, mode in enumerate(KILLS[stage]):
            rng = random.Random(f"{stage}-{seed}")
            where = kill_at_random(proj, stage, rng, horizon, when_writing=mode == "write")
            assert_no_unfinished_output(proj, ref, stage, where)
        torch.set_num_threads(RERUN_THREADS)
        try:
            inprocess(proj, stage)
        finally:
            torch.set_num_threads(threads)
    got = proj.snapshot(stage)
    assert sorted(got) == sorted(ref)
    for rel in ref:
        assert got[rel] == ref[rel], f"{stage}: {rel} differs from the uninterrupted run after kills"
    assert temp_siblings(proj, stage) == [], "temporary files of the killed runs were left behind"
