"""Stage `negatives`: DeGLA's hard negatives (5 rewrite types, merged to K = 4) for the training captions.

Backends (`negatives.backend`): `rules` (spaCy/WordNet, CPU; the sample world's default), `server` (any
OpenAI-compatible endpoint such as `vllm serve`), `offline` (`vllm.LLM`). GPUs: a server on this host runs on the
cards `compute.llm_gpus` keeps out of the model stages' ranks (the last ones: recipes/degla.yaml starts it there);
the offline engine runs inside this stage on the first visible GPU, locked against concurrent queued stages
(`compute.gpu_locks`), and frees it when the stage ends. Both sample alike (llm.py TOP_P). Answers are cached in
`negatives.cache_dir` (outside DVC's outputs), so a re-run asks nothing already answered. A request still
unanswered after its retries fails the stage (exit status 1, the count in the message) unless there are at most
`negatives.max_failures` of them; the re-run then asks only the missing ones.
Outputs: data/prepared/negatives.parquet, data/prepared/negatives.meta.json, metrics/negatives.json.
"""
from __future__ import annotations

import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # `python stages/<name>.py`: this checkout first
from stages._common import StageParams, hold_gpus, source_specs, start_preparing, visible_gpus

OUT = Path("data/prepared/negatives.parquet")
META = Path("data/prepared/negatives.meta.json")
METRICS = Path("metrics/negatives.json")


def make_backend(p: StageParams):
    from clipfinetune.data.negatives.degla.llm import TOP_P, OfflineBackend, ServerBackend
    from clipfinetune.data.negatives.degla.rules_backend import RulesBackend

    # read every declared key whatever the backend, so dvc.yaml and the code cannot drift apart
    cfg = {k: p[f"negatives.{k}"] for k in ("backend", "base_url", "model", "api_key_env", "concurrency",
                                            "timeout", "max_retries", "backoff", "max_tokens",
                                            "temperature", "seed")}
    sampling = f"t={cfg['temperature']},top_p={TOP_P},max_tokens={cfg['max_tokens']},seed={cfg['seed']}"
    if cfg["backend"] == "rules":
        return RulesBackend(seed=int(cfg["seed"])), cfg
    if cfg["backend"] == "server":
        b = ServerBackend(cfg["base_url"], cfg["model"], os.environ.get(cfg["api_key_env"] or "", ""),
                          concurrency=cfg["concurrency"], timeout=cfg["timeout"], max_retries=cfg["max_retries"],
                          backoff=cfg["backoff"], max_tokens=cfg["max_tokens"], temperature=cfg["temperature"],
                          seed=cfg["seed"])
    elif cfg["backend"] == "offline":
        b = OfflineBackend(cfg["model"], max_tokens=cfg["max_tokens"], temperature=cfg["temperature"],
                           seed=cfg["seed"])
    else:
        raise SystemExit(f"params.yaml: negatives.backend must be rules | server | offline, got {cfg['backend']!r}")
    b.cache_id = f"{cfg['model']}|{sampling}"      # in the cache key: sampling settings change the answers
    return b, cfg


def run(p: StageParams, log) -> dict:
    import pandas as pd

    from clipfinetune.data.negatives.degla.cache import AnswerCache
    from clipfinetune.data.negatives.degla.generate import (
        COLUMNS,
        MissingAnswersError,
        caption_records,
        generate_negatives,
    )
    from clipfinetune.data.negatives.degla.llm import prompt_version
    from clipfinetune.data.readers import read_source, source_paths
    from clipfinetune.io import write_json, write_parquet

    (name,) = p["negatives.sources"]                 # one source (start_preparing checked it)
    spec = source_specs(p, name)[name]
    per_caption = int(p["negatives.per_caption"])
    cache_dir = Path(p["negatives.cache_dir"])
    max_failures = int(p["negatives.max_failures"])
    backend, cfg = make_backend(p)
    p.check_all_read()
    if backend.name == "offline":                    # vLLM's engine takes the first visible GPU: not beside a rank
        hold_gpus(visible_gpus()[:1], log)
    if backend.name == "rules":
        log.info("negatives: backend=rules (spaCy/WordNet, no LLM) -- set negatives.backend: server|offline "
                 "to use an LLM as DeGLA does")
    skips: Counter = Counter()
    records = caption_records(read_source(name, spec, skips))
    pv = prompt_version() if backend.name != "rules" else "rules"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{backend.name}-{backend.model}")
    t0 = time.time()
    with AnswerCache(cache_dir / f"answers-{slug}.jsonl") as cache:
        try:
            rows, stats = generate_negatives(records, backend, cache, pv, per_caption=per_caption,
                                             seed=int(cfg["seed"]), max_failures=max_failures)
        except MissingAnswersError as e:
            raise SystemExit(f"negatives: {e} (cache: {cache.path}). Re-run the stage (`dvc repro negatives`), "
                             f"or set negatives.max_failures >= {e.failed} to accept the gaps") from e
    stats.update(seconds=round(time.time() - t0, 2), captions_file=source_paths(spec)[0],
                 skipped=dict(skips), cache_file=str(cache.path))
    if backend.name == "offline":
        stats["vllm_version"] = backend.vllm_version
    if backend.name == "server":
        stats["endpoint"] = backend.url
    frame = pd.DataFrame(rows, columns=list(COLUMNS)).astype({"caption_index": "int64"})
    write_parquet(OUT, frame)
    write_json(META, stats)
    write_json(METRICS, {"negatives": {"valid4_rate": stats["valid4_rate"], "reject_rate": stats["reject_rate"],
                                       "backend": stats["backend"]}})
    log.info("negatives: %d captions -> %d rows; valid4_rate %.1f%%, reject_rate %.1f%% (%s, asked %d, cached %d)",
             stats["captions"], stats["rows"], stats["valid4_rate"], stats["reject_rate"], stats["backend"],
             stats["requests_asked"], stats["answers_from_cache"])
    return stats


def main() -> None:
    _, params, log = start_preparing(__doc__, "negatives")
    run(params, log)


if __name__ == "__main__":
    main()
