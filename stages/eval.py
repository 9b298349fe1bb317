"""Stage `eval@<model>`: the evaluation suite on models/<model> -> metrics/<model>.json (DVC metrics) and
metrics/items/<model>.parquet (every query's / box's / test case's outcome, clipfinetune/eval/items.py; its schema
metadata holds the metrics file's text under `items.METRICS_KEY`).

Benchmarks come from `eval.benchmarks` (task -> set -> paths); unconfigured ones are listed under
"skipped" in the metrics file. Run by hand: python stages/eval.py --model clip [--stage eval@clip].
"""
from __future__ import annotations

import time
from pathlib import Path

import _common  # noqa: F401  (puts the repo root on sys.path)
import torch
from _common import start

from clipfinetune.eval.items import METRICS_KEY, to_frame
from clipfinetune.eval.suite import evaluate_model
from clipfinetune.io import write_json, write_parquet


def load_exported(name: str):
    from clipfinetune.models import load_model

    path = Path("models") / name
    if not path.is_dir():
        raise SystemExit(f"models/{name} does not exist: run `dvc repro train@{name}` (or `pretrain` for base)")
    return load_model(f"local-dir:{path}").eval()


def main() -> None:
    args, params, log = start(__doc__, lambda a: "eval_base" if a.model == "base" else f"eval@{a.model}", lambda p: p.add_argument(
        "--model", required=True, help="folder under models/ (base, clip, harmoclip, ...)"))
    if params["eval.threads"]:
        torch.set_num_threads(int(params["eval.threads"]))
    text_encoder = params["eval.box_cls.text_encoder"]
    model = load_exported(args.model)
    text_model = load_exported("base") if text_encoder == "base" and args.model != "base" else model
    t0 = time.perf_counter()
    items: list = []
    metrics = evaluate_model(model, params["eval.benchmarks"], batch_size=params["eval.batch_size"],
                             text_model=text_model, text_encoder=text_encoder, aro_seed=params["eval.aro_seed"],
                             cache_dir=params["eval.cache_dir"] or None, items=items)
    metrics["meta"]["model"] = args.model
    table = to_frame(items)
    metrics_file = Path("metrics") / f"{args.model}.json"
    write_json(metrics_file, metrics)
    # the items file carries the metrics file too: `report` depends on the metrics/items folder alone (a folder dep
    # on metrics/ would hold its own metrics/summary.json), and sees a change of either
    write_parquet(Path("metrics") / "items" / f"{args.model}.parquet", table, {METRICS_KEY: metrics_file.read_text()})
    log.info("wrote metrics/%s.json and %d item outcomes in %.1fs; skipped: %s", args.model, len(table),
             time.perf_counter() - t0, sorted(metrics["skipped"]))
    params.check_all_read()


if __name__ == "__main__":
    main()
