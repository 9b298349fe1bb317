"""The checks: what would stop or silently degrade a run, as refusals naming the param to change and values that
work (warnings for what only wastes work)."""
from __future__ import annotations

import json

from clipfinetune.project.plan.common import (
    DOWNSTREAM,
    STAGE_SOURCE_KIND,
    Refusal,
    _get,
    _has,
    _kind_of_source,
    _method,
    _producing,
    _sources_of_kind,
    _tables_needed,
)
from clipfinetune.project.plan.dag import DagStage


# ---------------------------------------------------------------------------------------------- the checks
def _declared_params(stages: list[DagStage], params: dict) -> list[Refusal]:
    """A stage that declares `compute` (the hardware: stages/_common.py reads it, no stage does, so the stage would
    stop with "declared params never read") or a key the params lack (`dvc repro` stops: missing params)."""
    out = []
    for st in stages:
        for key in st.declared:
            if key.split(".")[0] == "compute":
                out.append(Refusal(st.name, key, "declared in dvc.yaml, but compute is the hardware: no stage reads "
                                   "it as a param (stages/_common.py does), so the stage would stop with 'declared "
                                   "params never read' and every rank change would re-run it",
                                   [f"remove {key} from the stage's params in dvc.yaml"]))
            elif not _has(params, key):
                out.append(Refusal(st.name, key, "declared in dvc.yaml but absent from the params: dvc repro stops "
                                   "on missing params", [f"add {key} to the params file"]))
    return out


def _tables_written(stages: list[DagStage], params: dict, runs: dict) -> list[Refusal]:
    """A run whose records need a table (word-region pairs, negatives, sentences, local pairs) that no stage of the
    DAG writes, or whose kind of caption no shard source holds: it would stop on "no records", or (a run without
    its local pairs) silently train as its global-only ablation."""
    out = []
    for name, run in runs.items():
        method = _method(run)
        for table, base in _tables_needed(run):
            if _producing(stages, base):
                continue
            kind = STAGE_SOURCE_KIND[base]
            fix_sources = _sources_of_kind(params, kind) or [n for n, s in (_get(params, "sources") or {}).items()
                                                            if _kind_of_source(params, n) == kind]
            chain = [base] + (["segments", "sentences"] if base == "lism" else [])
            fixes = [f"{b}.sources: [{fix_sources[0]}]" for b in chain] if fix_sources else []
            switches = method.tables_switched_off_by()
            if switches:
                fixes.append("or a run that reads none (a global-only run): "
                             + " and ".join(f"runs.{name}.{w}: 0" for w in switches))
            fixes.append("or apply the paper's recipe over the committed base (recipes/)")
            silently = " and would silently train as its global-only ablation" if base == "lism" else ""
            out.append(Refusal(f"train@{name}", f"{base}.sources",
                               f"run {name} (method {run['method']}) reads {table}, which stage {base} writes, but "
                               f"{base}.sources is {_get(params, f'{base}.sources')!r}: no stage writes them"
                               f"{silently}", fixes))
        for kind in sorted(method.caption_kinds() if method is not None else ()):
            if not _sources_of_kind(params, kind):
                wanted = "long-caption (DOCCI-format)" if kind == "long" else "short-caption (COCO-format)"
                have = [n for n, s in (_get(params, "sources") or {}).items() if _kind_of_source(params, n) == kind]
                out.append(Refusal(f"train@{name}", "shards.sources",
                                   f"run {name} (method {run['method']}) trains on {wanted} records, "
                                   "but shards.sources "
                                   f"{_get(params, 'shards.sources')!r} holds none",
                                   [f"shards.sources: [..., {n}]" for n in have[:1]]))
    return out


def _tables_unread(stages: list[DagStage], params: dict, runs: dict) -> list[str]:
    """Data stages that run although no run (and no other stage, and no eval set) reads their table: work for
    nothing (a recipe applied over another's leftovers)."""
    readers: set[str] = set()
    for run in runs.values():
        readers |= {base for _, base in _tables_needed(run)}
    evalsets = json.dumps(_get(params, "eval.evalsets") or {})
    if "data/evalsets/global_local" in evalsets:
        readers.add("lism")                           # lism also writes the global-local test list
    for base in list(readers):
        readers |= set(DOWNSTREAM.get(base, []))
    if "lism" in readers:
        readers |= {"segments", "sentences"}
    out = []
    for base in STAGE_SOURCE_KIND:
        names = _producing(stages, base)
        if names and base not in readers:
            out.append(f"{', '.join(names)} runs but no run or evaluation set of this configuration reads its "
                       f"table: {base}.sources: [] leaves it out")
    return out


def _sample_sets_on_real_model(params: dict) -> list[Refusal]:
    """A real model (model.pretrained set) scored on the sample world's sets: meaningless numbers in the report."""
    if not _get(params, "model.pretrained"):
        return []
    keys = [f"eval.evalsets.{task}.{name}" for task, by_set in (_get(params, "eval.evalsets") or {}).items()
            for name, cfg in (by_set or {}).items() if cfg and "data/sample" in json.dumps(cfg)]
    if not keys:
        return []
    fixes = [f"{k}: null" for k in keys] + (["eval.report.set: real"] if _get(params, "eval.report.set") == "sample"
                                            else [])
    return [Refusal("", keys[0] if len(keys) == 1 else "eval.evalsets",
                    f"{len(keys)} sample-world set(s) would score a real model (model.pretrained is set): "
                    f"{', '.join(keys)}", fixes)]


def _missing_inputs(params, root, stages, leakage, timeout, warnings, asks_llm: bool = True) -> list[Refusal]:
    """Every missing input as a refusal (`clipfinetune.project.validate.check`); the LLM endpoint is probed only when a
    negatives stage will run (`asks_llm`): once its table is up to date the server may be stopped."""
    from clipfinetune.project.data import missing_by_dataset
    from clipfinetune.project.validate import check

    produced = [o for s in stages for o in s.outs]
    out, absent = [], []
    for f in check(params, root, timeout, produced=produced, leakage_check=leakage, asks_llm=asks_llm):
        if f.missing and f.key.startswith("negatives."):
            out.append(Refusal("", f.key, f"no LLM endpoint: {f.message}",
                               [(f"start the server first: vllm serve {_get(params, 'negatives.model')} "
                                "--generation-config vllm (the recipe's header: on its own GPU)"),
                                "negatives.backend: offline"]))
        elif f.missing and "does not exist" in f.message and isinstance(_get(params, f.key), str):
            absent.append(f)              # grouped below by the dataset that provides it
        elif f.missing:
            out.append(Refusal("", f.key, f"missing input: {f.message}",
                               [f"{f.key}: a path that exists (params.real.yaml lists the layouts), or provide it"]))
        else:
            warnings.append(f"{f.key}: {f.message}")
    messages = {f.key: f.message for f in absent}
    for dataset, pairs, how in missing_by_dataset([(f.key, _get(params, f.key)) for f in absent]):
        keys = ", ".join(k for k, _ in pairs)
        if dataset is None:           # no dataset of the manifest provides it
            out.append(Refusal("", keys, f"missing input: {messages[keys]}",
                               [f"{keys}: a path that exists (params.real.yaml lists the layouts), or provide it"]))
        else:
            paths = ", ".join(sorted({p for _, p in pairs}))
            out.append(Refusal("", keys, f"missing data: {dataset} ({paths})", [how]))
    if not leakage:
        warnings.append("leakage between training and evaluation images: checked by the shards stage (or here with "
                        "--leakage: the first run hashes every training image)")
    return out
