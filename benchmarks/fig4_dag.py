"""Figure 4 (only with `--dag`): wall time and peak memory of `dvc repro` of the whole sample DAG from scratch.

The repository's files (tracked + untracked-but-not-ignored, i.e. what a fresh clone plus local edits holds;
no data/, models/, dvc.lock, caches) are copied into a temporary folder, `git init` + one commit there, then
`dvc repro` runs with this venv first on PATH. Memory: the summed RSS of dvc's whole process tree polled every
0.5 s (peak), plus the largest single process. Goals: <= 20 min, < 4 GB.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import ENV, ROOT, Row


def copy_repo(dst: Path) -> int:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           stdout=subprocess.PIPE).stdout.decode().split("\0")
    n = 0
    for f in filter(None, files):
        src = ROOT / f
        if f == "dvc.lock" or not src.is_file() or f.startswith("benchmarks/_work"):
            continue
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / f)
        n += 1
    return n


def figure(keep: bool = False, log=print) -> list[Row]:
    import psutil

    tmp = Path(tempfile.mkdtemp(prefix="cft-dag-"))
    try:
        n = copy_repo(tmp)
        env = {**ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
               "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost"}
        env.pop("PYTHONPATH", None)
        for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "bench"]):
            subprocess.run(cmd, cwd=tmp, env=env, check=True)
        dvc = str(Path(sys.executable).parent / "dvc")
        cmd = ["nice", "-n", "19", dvc, "repro"]
        log(f"  fig4: {n} files copied to {tmp}; running {' '.join(cmd)} ...")
        t0 = time.perf_counter()
        logf = open(tmp / "repro.log", "w")
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=logf, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        peak_tree = peak_single = 0
        while proc.poll() is None:
            try:
                procs = [root, *root.children(recursive=True)]
                rss = []
                for p in procs:
                    try:
                        rss.append(p.memory_info().rss)
                    except psutil.Error:
                        pass
                peak_tree, peak_single = max(peak_tree, sum(rss)), max(peak_single, max(rss, default=0))
            except psutil.Error:
                pass
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        logf.close()
        rc = proc.returncode
        tail = (tmp / "repro.log").read_text()[-2000:]
        gb = peak_tree / 1e9
        log(f"  fig4: rc {rc}, {wall / 60:.1f} min, peak tree RSS {gb:.2f} GB")
        ok = rc == 0
        return [Row("4 whole DAG from scratch (min)", wall / 60, 20.0, wall / 60 / 20.0, "<= 20 min",
                    ok and wall <= 1200, "min", {"returncode": rc, "log_tail": tail if not ok else ""},
                    [f"copy of the repo into {tmp}; git init; {' '.join(cmd)}"]),
                Row("4 whole DAG peak RSS (GB)", gb, 4.0, gb / 4.0, "< 4 GB", ok and gb < 4.0, "GB",
                    {"peak_single_process_gb": peak_single / 1e9, "poll_interval_s": 0.5},
                    ["psutil: summed RSS of the dvc process tree, polled every 0.5 s"])]
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
