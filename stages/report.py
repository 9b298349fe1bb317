"""Stage `report`: metrics/<model>.json and metrics/items/<model>.parquet of every model -> metrics/summary.json
(headline table, deltas vs base and clip, CLAIMS with paired-bootstrap CIs and verdicts), reports/summary.md and
the trade-off plots in reports/. Models without a metrics file are reported as missing, so it also runs by hand
mid-development: python stages/report.py --stage report
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import start

from clipfinetune.io import InputError, atomic_path, write_json
from clipfinetune.report.plots import write_plots
from clipfinetune.report.summary import load_items, load_metrics, render_markdown, summarize


def main() -> None:
    _, params, log = start(__doc__, "report")
    models = ["base", *params["runs"]]          # eval_base, then eval@<run> for every run
    metrics = load_metrics({m: Path("metrics") / f"{m}.json" for m in models})
    items = load_items({m: Path("metrics") / "items" / f"{m}.parquet" for m in models})
    paper, numbers_file, name = None, Path(params["eval.report.paper_numbers"]), params["eval.report.paper"]
    if name:                            # a recipe names its paper: its own numbers beside ours
        import yaml

        numbers = yaml.safe_load(numbers_file.read_text()) or {}
        if name not in numbers:
            raise InputError(numbers_file, name, f"no such paper (papers: {sorted(numbers)})")
        paper = numbers[name]
    summary = summarize(metrics, params["eval.report.set"], items, n_resamples=int(params["eval.report.resamples"]),
                        seed=int(params["eval.report.seed"]), paper=paper)
    plots = write_plots(summary, "reports")
    write_json("metrics/summary.json", summary)
    with atomic_path("reports/summary.md") as tmp:
        tmp.write_text(render_markdown(summary, plots))
    held = {f"{m}.{n}": c["verdict"] for m, cs in summary["claims"].items() for n, c in cs.items()}
    log.info("claims: %s; missing models: %s", held, summary["missing_models"])
    params.check_all_read()


if __name__ == "__main__":
    main()
