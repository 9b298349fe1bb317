"""Stage `eval@<model>`: the evaluation suite on models/<model> -> metrics/<model>.json (DVC metrics) and
metrics/items/<model>.parquet (every query's / box's / test case's outcome, clipfinetune/eval/items.py; its schema
metadata holds the metrics file's text under `items.METRICS_KEY`).

Benchmarks come from `eval.evalsets` (task -> set -> paths); unconfigured ones are listed under
"skipped" in the metrics file. Run by hand: python stages/eval.py --model clip [--stage eval@clip].

The models run on the device of `compute.device` (stages/_items.py; recorded in the metrics' meta), in fp32.
Under torchrun the encoding is split across ranks (clipfinetune/eval/sharded.py): every rank plans the suite's
batches, computes its share (images decoded in DataLoader workers, as many as the host offers a rank:
clipfinetune/host.py) as part files under data/cache/eval-<model>/<fingerprint>/, and rank 0 scores every benchmark
from them, so the outputs equal a one-process run's and a killed run resumes from its parts.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages import _items
from stages._common import ITEMS, start

import torch

from clipfinetune import host
from clipfinetune.eval import sharded
from clipfinetune.eval.items import METRICS_KEY, to_frame
from clipfinetune.eval.suite import evaluate_model, make_encoders
from clipfinetune.io import write_json, write_parquet


def load_exported(name: str, device="cpu"):
    from clipfinetune.models import load_model

    path = Path("models") / name
    if not path.is_dir():
        raise SystemExit(f"models/{name} does not exist: run `dvc repro train@{name}` (or `pretrain` for base)")
    return load_model(f"local-dir:{path}", device=device).eval()


def main() -> None:
    args, params, log = start(
        __doc__, lambda a: "eval_base" if a.model == "base" else f"eval@{a.model}", lambda p: p.add_argument(
        "--model", required=True, help="folder under models/ (base, clip, harmoclip, ...)"), ITEMS)
    threads = host.count("eval_threads")      # the host's, not a param: a changed count re-runs no stage
    if threads:
        torch.set_num_threads(threads)
    dist = _items.setup_device(params)
    text_encoder = params["eval.box_cls.text_encoder"]
    model = load_exported(args.model, dist.device)
    text_model = load_exported("base", dist.device) if text_encoder == "base" and args.model != "base" else model
    t0 = time.perf_counter()
    evalsets, batch_size = params["eval.evalsets"], params["eval.batch_size"]
    suite_args = {"text_encoder": text_encoder, "aro_seed": params["eval.aro_seed"],
                  "cache_dir": params["eval.cache_dir"] or None}
    workers = host.count("eval")
    log.info("%d DataLoader workers, %d torch threads per rank (clipfinetune/host.py)", workers,
             torch.get_num_threads())

    # every rank plans the suite's encoder batches (no forward), computes its share, rank 0 scores from the parts
    plan = sharded.plan_batches(model, evalsets, batch_size, text_model, **suite_args)
    log.info("planned the suite's encoding: %d batches", len(plan))
    encoders = make_encoders(model, text_model, text_encoder, batch_size)
    by_tag = {"model": encoders[0], "text_model": encoders[1]}
    store = _items.part_store(params, {"model": args.model, "batch_size": batch_size, "evalsets": evalsets,
                                       "threads": threads, **suite_args}, dist.device, codec="torch")
    results = _items.run_sharded(
        store, [[unit] for unit in plan], sharded.unit_id,
        lambda units: (res for _, res in sharded.encode_units([u[0] for u in units], by_tag, workers)),
        dist, log, f"eval@{args.model} encoding", stream=True)
    params.check_all_read()
    if results is None:               # not rank 0: its parts are written
        _items.finish(dist)
        return
    sharded.fill_encoders(plan, results, by_tag)
    items: list = []
    metrics = evaluate_model(model, evalsets, batch_size, text_model, items=items, encoders=encoders, **suite_args)
    metrics["meta"]["model"] = args.model
    metrics["meta"]["device"] = str(dist.device)
    metrics["meta"]["precision"] = "fp32"          # evaluation never autocasts (model.precision is training's)
    table = to_frame(items)
    metrics_file = Path("metrics") / f"{args.model}.json"
    write_json(metrics_file, metrics)
    # the items file carries the metrics file too: `report` depends on the metrics/items folder alone (a folder dep
    # on metrics/ would hold its own metrics/summary.json), and sees a change of either
    write_parquet(Path("metrics") / "items" / f"{args.model}.parquet", table, {METRICS_KEY: metrics_file.read_text()})
    log.info("wrote metrics/%s.json and %d item outcomes in %.1fs; skipped: %s", args.model, len(table),
             time.perf_counter() - t0, sorted(metrics["skipped"]))
    store.clear()
    _items.finish(dist)


if __name__ == "__main__":
    main()
