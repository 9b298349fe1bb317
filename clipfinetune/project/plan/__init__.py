"""`clipfinetune plan`: what `dvc repro` would run in the applied configuration, on N GPUs, and what would stop it.

    clipfinetune plan [--gpus N] [--nodes M] [--params params.yaml] [--gpu-kind NAME] [--json] [--leakage]
    python -m clipfinetune.project.plan ...

It reads the params file, asks DVC for the stages of its DAG (foreach bodies and `[]` sources exactly as `dvc repro`
expands them) and resolves, per stage: device, ranks (clipfinetune.compute's rules, the ones the stages' launcher
applies), per-rank batch, steps per epoch, units seen and repeated per epoch (exact from the shards' index through
`clipfinetune.data.loader.epoch_coverage` when the shards exist; before, estimated from the sources' record counts
and marked so), input and output sizes, LLM requests, and a wall time from measured throughput
(benchmarks/calibration.json, each figure with its source), marked measured, scaled (from what, by what rule: a
per-rank batch under the measured one interpolated between the card's latency floor and the batch-128 rate, a rank
fed at most at its loader workers' rate) or unknown. The total is printed as "at least", with the share of stages it
covers, and GPU-hours; a paper's own stated cost stands beside its run; a latency-bound per-rank batch (under ~32)
is named with the better layout (the runs side by side on a share of the GPUs each).

It exits 1 BEFORE any work, naming the param to change and values that would work, when the configuration would stop
or silently degrade a run: a batch that does not split over the ranks, a stage declaring params it will not read
(`compute`, the hardware) or that the params lack, a run reading a table that no stage of the configuration writes
(e.g. local pairs with `lism.sources: []`), a GPU shared by a vLLM server and the ranks, sample-world sets
scored on a real model, epoch coverage under 100%, and every missing input (`clipfinetune.project.validate.check`).
Warnings (idle GPUs, stages whose table no run reads, several nodes) do not fail it.

`make_plan(params, root, ...)` is the library entry (a dict in, a dict out); only `main` reads the params file.
The parts: `dag` (resolving the DAG, whether a stage is up to date from dvc.lock), `hardware` (GPUs and ranks, the
vLLM server's card), `sizes` (each stage's row: units, sizes, time from the measured figures), `checks` (the
refusals), `common` (their shared vocabulary). What the plan needs to know about a method it asks the method's
hooks (clipfinetune/methods/base.py: `prepared_tables`, `caption_kinds`, `units_table`), never its name.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from clipfinetune import compute as rules
from clipfinetune.keys import BothSpellings, respell
from clipfinetune.project.formatting import fmt_bytes
from clipfinetune.project.plan.checks import (
    _declared_params,
    _missing_inputs,
    _sample_sets_on_real_model,
    _tables_unread,
    _tables_written,
)
from clipfinetune.project.plan.common import (
    ITEM_SCRIPTS,
    MINOR,
    Hardware,
    Refusal,
    StageRow,
    _fmt_int,
    _fmt_seconds,
    _get,
    _producing,
)
from clipfinetune.project.plan.dag import DagStage, LockedStages, _cache_type, dag_stages
from clipfinetune.project.plan.hardware import _llm_beside_ranks, visible_hardware
from clipfinetune.project.plan.sizes import (
    StepTime,
    _data_row,
    _item_row,
    _latency_advice,
    _pretrain_row,
    _Records,
    _Sizes,
    _training_row,
    find_figure,
    load_calibration,
    step_time,
)
from clipfinetune.runs import resolve_runs

__all__ = [
    "ITEM_SCRIPTS",
    "DagStage",
    "Hardware",
    "LockedStages",
    "Refusal",
    "StageRow",
    "StepTime",
    "dag_stages",
    "find_figure",
    "load_calibration",
    "main",
    "make_plan",
    "render",
    "step_time",
    "visible_hardware",
]


def make_plan(params: dict, root, hardware: Hardware, *, stages: list[DagStage] | None = None,
              leakage: bool = False, timeout: float = 5.0) -> dict:
    """The plan as a dict: hardware, stages (StageRow as dicts, DVC's order), refusals, warnings, total_seconds, ok.
    `stages`: DVC's view of the DAG (`dag_stages`). Whether a negatives stage would run (and so needs its LLM) comes
    from the project's dvc.lock (`LockedStages`)."""
    root = Path(root)
    stages = dag_stages(root) if stages is None else stages
    up_to_date = LockedStages(root, params, stages)
    negatives = _producing(stages, "negatives")
    asks_llm = bool(negatives) and not all(up_to_date(n) for n in negatives)
    refusals: list[Refusal] = []
    warnings: list[str] = []
    sizes, records = _Sizes(root), _Records(params, root)
    figures = load_calibration(root)

    # compute: the hardware the ranks use
    try:
        compute = rules.settings(_get(params, "compute"))
    except rules.ComputeError as e:
        refusals.append(Refusal("", e.param, str(e), e.fixes))
        compute = rules.settings(None)
    visible = [str(i) for i in range(hardware.gpus)]
    cuda = rules.uses_cuda(compute, len(visible))
    if compute["device"] == "cuda" and not visible:
        refusals.append(Refusal("", "compute.device", "cuda, but no GPU is visible (--gpus 0)",
                                ["compute.device: auto", "compute.device: cpu"]))
    try:
        gpus = rules.rank_gpus(compute, visible) if cuda else []
        most = rules.item_ranks(compute, len(gpus), cuda)
    except rules.ComputeError as e:
        fixes = e.fixes
        if e.param == "compute.llm_gpus":           # one card for the server and the ranks: not at the same time
            neg = ", ".join(_producing(stages, "negatives")) or "negatives@<source>"
            fixes = ["negatives.backend: offline (vLLM inside the stage: the card is free when it ends)",
                     f"or `dvc repro {neg}` first with the server, stop it, then compute.llm_gpus: 0"]
        refusals.append(Refusal("", e.param, str(e), fixes))
        gpus, most = [], 1
    device = "cuda" if cuda else "cpu"
    kind = hardware.gpu_kind if cuda else "cpu"

    runs = {}
    try:
        runs = resolve_runs(params)
    except Exception as e:  # noqa: BLE001  an unknown method or key: the train stage would stop on it
        refusals.append(Refusal("", "runs", f"the runs do not resolve: {e}"))

    refusals += _declared_params(stages, params)
    refusals += _tables_written(stages, params, runs)
    warnings += _tables_unread(stages, params, runs)
    refusals += _sample_sets_on_real_model(params)
    r, w = _llm_beside_ranks(stages, params, compute, hardware, asks_llm)
    refusals += r
    warnings += w
    refusals += _missing_inputs(params, root, stages, leakage, timeout, warnings, asks_llm)

    rows = []
    shards_dir = root / "data" / "shards"
    for st in stages:
        name = st.name
        inputs = [sizes(d) for d in st.deps]
        row = StageRow(name, "data", inputs_bytes=sum(s for s in inputs if s) if any(inputs) else None)
        existing = [sizes(o) for o in st.outs]
        if any(s is not None for s in existing):
            row.outputs_bytes, row.outputs_note = sum(s or 0 for s in existing), "as built"
        if st.script == "stages/train.py":
            _training_row(row, st, params, runs, compute, gpus, most, hardware, device, kind, figures, refusals,
                          warnings, records, shards_dir, sizes, root)
        elif st.script == "stages/pretrain.py":
            _pretrain_row(row, params, compute, gpus, most, hardware, device, kind, figures, refusals, warnings,
                          records)
        elif st.script in ITEM_SCRIPTS:
            _item_row(row, st, params, gpus, most, hardware, device, kind, figures, records)
        else:
            _data_row(row, st, params, figures, records, sizes)
        rows.append(row)

    warnings[:] = _merge_same(warnings)
    if hardware.nodes > 1:
        warnings.append(f"{hardware.nodes} nodes: `dvc repro` starts ranks on this node only; run each model stage "
                        "under torchrun on every node, then `dvc commit -f <stage>` (docs/scale.md, Several nodes)")
    if cuda:
        warnings.append("dvc queue start -j N on this host: the GPU stages of concurrent experiments take their "
                        "cards one at a time (a lock per GPU), only the data stages overlap; -j 1 is as fast for "
                        "GPU-bound work")
    warnings += _latency_advice(rows, figures, kind, str(_get(params, "model.name")), gpus, hardware.nodes)
    for r in rows:
        if r.seconds is not None:
            r.gpu_seconds = r.seconds * len(r.gpus) * hardware.nodes if r.device == "cuda" and r.gpus else 0.0
    counted = [r for r in rows if r.kind != "export" and r.stage.split("@", 1)[0] not in MINOR]
    known = [r.seconds for r in counted if r.seconds is not None]
    sized = [r.outputs_bytes for r in rows if r.outputs_bytes is not None]
    disk = {"outputs_bytes": sum(sized) if sized else None, "stages_unsized": len(rows) - len(sized),
            "cache_type": _cache_type(root)}
    return {"disk": disk, "hardware": {**asdict(hardware), "device": device, "rank_gpus": gpus, "compute": compute},
            "stages": [asdict(r) for r in rows], "refusals": [asdict(r) for r in refusals], "warnings": warnings,
            "total_seconds": sum(known) if known else None,      # at least: the stages with a time only
            "timed_stages": len(known), "counted_stages": len(counted),
            "gpu_hours": sum(r.gpu_seconds or 0 for r in counted) / 3600 if known else None,
            "unknown_time": _grouped([r.stage for r in rows if r.seconds is None and r.kind != "export"
                                      and r.stage not in MINOR]),
            "ok": not refusals}


def _grouped(names: list[str]) -> list[str]:
    """Stage names with foreach bodies counted: ["train@* (12)", "shards", ...]."""
    counts: dict[str, int] = {}
    for n in names:
        base = n.split("@", 1)[0] + "@*" if "@" in n else n
        counts[base] = counts.get(base, 0) + 1
    return [f"{b} ({c})" if c > 1 else (b if not b.endswith("@*") else next(n for n in names if n.startswith(b[:-1])))
            for b, c in counts.items()]


def _merge_same(warnings: list[str]) -> list[str]:
    """"train@a: 4 of 7 GPUs ..." and "train@b: 4 of 7 GPUs ..." (the same text after the stage) -> one line naming
    both stages."""
    out: dict[str, list[str]] = {}
    for w in warnings:
        stage, sep, rest = w.partition(": ")
        if sep and "@" in stage and " " not in stage:
            out.setdefault(rest, []).append(stage)
        else:
            out.setdefault(w, [])
    return [f"{', '.join(stages)}: {text}" if stages else text for text, stages in out.items()]


# ----------------------------------------------------------------------------------------------- output
COLUMNS = ("stage", "device", "ranks", "batch/rank", "steps x epochs", "units/epoch (seen, repeated)", "items",
           "in", "out", "LLM req", "time (basis)")


def _cells(r: dict) -> list[str]:
    batch = f"{r['rank_batch']} (of {r['global_batch']})" if r["rank_batch"] else "-"
    steps = f"{r['steps_per_epoch']:,} x {r['epochs']}" if r["steps_per_epoch"] else \
        (f"? x {r['epochs']}" if r["epochs"] else "-")
    if r["units"] is not None:
        units = f"{r['units']:,} ({r['seen']:,}, {r['repeated']:,}) {r['coverage']}"
    else:
        units = r["coverage"] or "-"
    items = f"{r['items']:,} {r['items_what']}" if r["items"] is not None else "-"
    device = r["device"] + (f" {','.join(r['gpus'])}" if r["gpus"] else "")
    out = fmt_bytes(r["outputs_bytes"]) + (" est." if r["outputs_note"].startswith("estimated") else "")
    return [r["stage"], device, str(r["ranks"]), batch, steps, units, items, fmt_bytes(r["inputs_bytes"]), out,
            _fmt_int(r["llm_requests"]),
            (f"{_fmt_seconds(r['seconds'])} {r['basis']}" if r["seconds"] is not None else "unknown")
            if r["kind"] != "export" else "seconds"]


def render(plan: dict) -> str:
    hw = plan["hardware"]
    lines = [f"clipfinetune plan: {hw['nodes']} node(s) x {hw['gpus']} GPU(s) ({hw['gpu_kind']}); model stages on "
             f"{hw['device']}" + (f", ranks on GPU(s) {','.join(hw['rank_gpus'])}" if hw["rank_gpus"] else "")]
    body = [_cells(r) for r in plan["stages"]]
    widths = [max(len(x) for x in col) for col in zip(COLUMNS, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    lines += [fmt(COLUMNS), fmt(["-" * w for w in widths]), *map(fmt, body)]
    total = plan["total_seconds"]
    share = f"{plan['timed_stages']} of {plan['counted_stages']} stages"
    lines.append((f"time: at least {_fmt_seconds(total)} (the {share} with a measured or scaled time; "
                  f"GPU-hours at least {plan['gpu_hours']:.2f})" if total is not None else
                  f"time: unknown (none of the {plan['counted_stages']} stages has a measured rate here)")
                 + (f"; unknown: {', '.join(plan['unknown_time'])}" if plan["unknown_time"] else ""))
    papers = [f"  {r['stage']}: ours {_fmt_seconds(r['seconds'])} on {len(r['gpus']) or 1} GPU(s); the paper: "
              f"{r['paper']}" for r in plan["stages"] if r["paper"]]
    if papers:
        lines += ["the papers' stated cost beside ours:", *papers]
    disk = plan["disk"]
    copies = "once (linked from the cache)" if any(k in disk["cache_type"] for k in ("hardlink", "symlink")) else \
        "up to twice (workspace and cache: cache.type " + disk["cache_type"] + ")"
    lines.append(f"disk: outputs {fmt_bytes(disk['outputs_bytes'])} as built or estimated "
                 f"({disk['stages_unsized']} stages not sized), held {copies}")
    lines += [f"  time of {r['stage']} ({r['basis']}): {r['time_source']}" for r in plan["stages"]
              if r["seconds"] is not None or r["time_source"].startswith("unknown:")]
    notes = [f"  {r['stage']}: {n}" for r in plan["stages"] for n in r["notes"]]
    if notes:
        lines += ["notes:", *notes]
    if plan["warnings"]:
        lines += ["warnings:", *[f"  - {w}" for w in plan["warnings"]]]
    if plan["refusals"]:
        data = [r for r in plan["refusals"] if r["message"].startswith("missing data: ")]
        rest = [r for r in plan["refusals"] if r not in data]
        lines += [f"REFUSED ({len(plan['refusals'])}): change these before `dvc repro`:",
                  *[f"  - {Refusal(**r)}" for r in rest]]
        if data:                      # one line per dataset: `clipfinetune data` has the table, sizes and steps
            lines.append("  missing data, by dataset (`clipfinetune data` lists them, `clipfinetune data --fetch` "
                         "downloads those with a direct link):")
            lines += [f"  - {r['message'][len('missing data: '):]}: {r['fixes'][0]} (read by {r['param']})"
                      for r in data]
    else:
        lines.append("plan: OK, nothing refused")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clipfinetune plan", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: those visible here)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: $SLURM_JOB_NUM_NODES, else 1)")
    p.add_argument("--params", default="params.yaml", help="the applied params file (default params.yaml)")
    p.add_argument("--root", default=None, help="project root (default: the params file's folder)")
    p.add_argument("--gpu-kind", default=None, help="the GPU's name for the measured rates, e.g. 'NVIDIA H200' "
                   "(default: the visible GPU's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--leakage", action="store_true", help="also compare training and evaluation images (slow once)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for the LLM endpoint check")
    args = p.parse_args(argv)
    import yaml

    t0 = time.perf_counter()
    params_path = Path(args.params)
    if not params_path.is_file():
        print(f"clipfinetune plan: {params_path} does not exist", file=sys.stderr)
        return 1
    root = Path(args.root) if args.root else params_path.resolve().parent
    try:
        params = respell(yaml.safe_load(params_path.read_text()) or {}, str(params_path))
    except BothSpellings as e:
        print(f"clipfinetune plan: {e}", file=sys.stderr)
        return 1
    seen, name = visible_hardware() if args.gpus is None or args.gpu_kind is None else (0, "cpu")
    gpus = seen if args.gpus is None else args.gpus
    kind = args.gpu_kind or (name if seen else ("cpu" if gpus == 0 else "unknown GPU (--gpu-kind)"))
    nodes = args.nodes or int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    try:
        stages = dag_stages(root, params_path)
    except Exception as e:  # noqa: BLE001  dvc.yaml's ${...} or foreach do not resolve: `dvc repro` would stop too
        print(f"REFUSED: DVC cannot read the pipeline of {root} with {params_path}: {type(e).__name__}: {e}")
        return 1
    plan = make_plan(params, root, Hardware(gpus, nodes, kind), stages=stages,
                     leakage=args.leakage, timeout=args.timeout)
    plan["seconds_to_plan"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(plan, indent=2, default=str) if args.json else render(plan))
    return 0 if plan["ok"] else 1
