"""`python -m benchmarks`: run the figures, print the table, write benchmarks/results.json (see __init__)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

from . import __name__ as _pkg  # noqa: F401  (sets OMP_WAIT_POLICY before torch loads)
from .common import ROOT, WORK, Row


def fmt(x, unit=""):
    if x is None:
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"


def table(rows: list[Row]) -> str:
    head = ["figure", "ours", "reference", "ratio", "goal", "pass/fail"]
    body = [[r.figure + (f" [{r.unit}]" if r.unit else ""), fmt(r.ours), fmt(r.reference),
             "-" if r.ratio is None else f"{r.ratio:.2f}", r.goal,
             {True: "PASS", False: "FAIL", None: "info"}[r.passed]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def write_results(path: Path, run: dict) -> None:
    """results.json keeps the newest measurement of each figure: a run's rows replace the older runs' rows of the
    figures it measured; older runs keep their other rows with their own date, command and machine."""
    runs = []
    if path.is_file():
        old = json.loads(path.read_text())
        runs = old.get("runs", [old] if "rows" in old else [])
    mine = set(run["figures"])
    kept = []
    for r in runs:
        r["rows"] = [row for row in r.get("rows", []) if figure_of(row) not in mine]
        if r["rows"]:
            r["figures"] = sorted({figure_of(row) for row in r["rows"]})
            kept.append(r)
    runs = kept + [run]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"runs": runs}, indent=2, default=str))
    os.replace(tmp, path)


def figure_of(row: dict) -> str:
    return row["figure"].split()[0]           # "2 goal time-ratio ..." -> "2"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--only", default="1,2,3",
                    help="comma-separated figures to run (default 1,2,3; 4 needs --dag; 5 = real size, ~15 min)")
    ap.add_argument("--dag", action="store_true", help="also run figure 4: `dvc repro` from scratch in a tmp copy")
    ap.add_argument("--keep", action="store_true", help="figure 4: keep the DAG's tmp copy (to run experiments in it)")
    ap.add_argument("--pairs", type=int, default=3, help="figure 1: interleaved ours/open_clip run pairs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results.json"))
    ap.add_argument("--scale", action="store_true",
                    help="only the COCO-sized rehearsal of the CPU data stages (benchmarks/scale.py)")
    ap.add_argument("--fraction", type=float, default=1.0, help="--scale: this fraction of COCO/DOCCI's size")
    ap.add_argument("--gpu", action="store_true", help="only the CUDA step table (benchmarks/gpu.py); without CUDA "
                    "it says so and exits 0")
    args = ap.parse_args(argv)
    if args.scale:
        from . import scale
        return scale.main(args.fraction)
    if args.gpu:
        from . import gpu
        return gpu.main(log=lambda msg: print(msg, file=sys.stderr, flush=True))
    figures = {f.strip() for f in args.only.split(",") if f.strip()} | ({"4"} if args.dag else set())
    WORK.mkdir(parents=True, exist_ok=True)

    import torch

    from .common import model_snapshot

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    model_dir, model_note = model_snapshot() if figures & {"1", "2", "3"} else (None, "")
    if model_dir:
        log(f"model: {model_dir} ({model_note})")
    rows: list[Row] = []
    if "1" in figures:
        from . import fig1_openclip
        log("figure 1: Trainer vs open_clip_train")
        rows += fig1_openclip.figure(model_dir, pairs=args.pairs, log=log)
    if "2" in figures:
        from . import fig2_methods
        log("figure 2: per-method efficiency")
        rows += fig2_methods.figure(model_dir, log=log)
    if "3" in figures:
        from . import fig3_data
        log("figure 3: data stages")
        rows += fig3_data.figure(model_dir, log=log)
    if "5" in figures:
        from . import fig5_real
        log("figure 5: real size (ViT-B-16 step, SAM vit_b)")
        rows += fig5_real.figure(log=log)
    if "6" in figures:
        from . import fig6_negatives
        log("figure 6: the negatives client against a local stub server (200,000 requests)")
        rows += fig6_negatives.figure(log=log)
    if "4" in figures:
        from . import fig4_dag
        log("figure 4: whole DAG from scratch")
        rows += fig4_dag.figure(keep=args.keep, log=log)
    text = table(rows)
    print(text)
    load = os.getloadavg()
    run = {"created": datetime.datetime.now().isoformat(timespec="seconds"),
           "command": f"nice -n {os.environ.get('BENCH_NICE', '19')} python -m benchmarks "
                      + " ".join(sys.argv[1:] if argv is None else argv),
           "figures": sorted(figures),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                       "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "loadavg_at_end": load},
           "model": {"path": str(model_dir), "note": model_note}, "wall_s": time.perf_counter() - t_start,
           "table": text, "rows": [r.as_dict() for r in rows]}
    write_results(Path(args.out), run)
    log(f"wrote {args.out} ({run['wall_s']:.0f} s)")
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
