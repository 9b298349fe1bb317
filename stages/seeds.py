"""K fine-tuning seeds through DVC's experiment queue, aggregated into mean ± sd per claim and headline metric.

Not a DAG stage: it drives the DAG. For each seed it queues `dvc exp run --queue -n seed<N> -S train.seed=<N>`,
starts the queue (`dvc queue start -j <jobs>`), waits until nothing is queued or running, then reads every
experiment's metrics/summary.json from `dvc exp show --json` and writes reports/seeds.md and metrics/seeds.json
(clipfinetune/report/seeds.py). `train.seed` is declared
by the train@<run> stages only, so an experiment re-runs the 12 train@ runs, their eval@ stages and report;
sample, the data stages, pretrain and eval_base come from the cache. Run from the project root after `make run` (the
baseline must be committed: experiments start from HEAD):
    python stages/seeds.py --k 3              # seeds 0 1 2 (`make seeds K=3`)
    python stages/seeds.py --collect-only     # only re-aggregate experiments seed0.. that already ran
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from clipfinetune.io import atomic_path, write_json
from clipfinetune.report.seeds import aggregate, render_markdown, summaries_from_exp_show


def dvc(*args: str) -> str:
    proc = subprocess.run(["dvc", *args], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def queue_busy() -> bool:
    """True while `dvc queue status` lists a queued or running task."""
    return any(word in line.split() for line in dvc("queue", "status").splitlines()[1:]
               for word in ("Queued", "Running"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=3, help="number of seeds: 0 .. K-1 (ignored with --seeds)")
    p.add_argument("--seeds", type=int, nargs="+", help="explicit train.seed values")
    p.add_argument("--jobs", type=int, default=1, help="experiments run at once (`dvc queue start -j`)")
    p.add_argument("--poll", type=float, default=30.0, help="seconds between queue status checks")
    p.add_argument("--collect-only", action="store_true", help="aggregate experiments that already ran")
    args = p.parse_args()
    seeds = args.seeds if args.seeds else list(range(args.k))
    names = [f"seed{s}" for s in seeds]
    if not args.collect_only:
        existing = set(dvc("exp", "list", "--name-only").split())
        clashing = [n for n in names if n in existing]
        if clashing:                  # re-running the command replaces the previous seed experiments
            dvc("exp", "remove", *clashing)
        # dvc.lock and the uncached metrics files (uncommitted after a fresh `make run`) go along, so the
        # experiment sees the unchanged stages as up to date instead of re-running or restoring them. File by
        # file: DVC's autostage puts metrics/items/.gitignore in the index, so the experiment's workspace already
        # has a metrics/ folder and copying the folder fails ("File exists"); the items are cached outputs.
        uncached = ["dvc.lock", *sorted(str(p) for p in Path("metrics").glob("*.json"))]
        copy = [arg for path in uncached if Path(path).exists() for arg in ("-C", path)]
        for seed, name in zip(seeds, names):
            dvc("exp", "run", "--queue", "-n", name, "-S", f"train.seed={seed}", *copy)
        t0 = time.perf_counter()
        dvc("queue", "start", "-j", str(args.jobs))
        while queue_busy():
            time.sleep(args.poll)
        print(f"{len(names)} experiments ran in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    summaries = summaries_from_exp_show(json.loads(dvc("exp", "show", "--json")), names)
    missing = [n for n in names if n not in summaries]
    if not summaries:
        raise SystemExit(f"no experiment finished with a metrics/summary.json: see `dvc queue status`, "
                         f"`dvc queue logs <name>` ({', '.join(names)})")
    agg = aggregate(summaries)
    agg["seeds"] = {n: s for n, s in zip(names, seeds) if n in summaries}
    write_json("metrics/seeds.json", agg)
    md = render_markdown(agg)
    with atomic_path("reports/seeds.md") as tmp:
        tmp.write_text(md)
    print(md, end="")
    if missing:
        raise SystemExit(f"experiments without a summary (failed?): {missing}; see `dvc queue status`")


if __name__ == "__main__":
    main()
