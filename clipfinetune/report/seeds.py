"""Seed spread: several experiments' metrics/summary.json (one per `train.seed`) -> mean ± sd per claim (value,
baseline, difference, verdict counts) and per headline metric. The experiments come from `dvc exp show --json`
(`summaries_from_exp_show`); stages/seeds.py queues and runs them. The sd is the sample standard deviation
(ddof 1) across seeds: run-to-run variation of fine-tuning, which the per-claim bootstrap CI (variation of the
test items) does not see.
"""
from __future__ import annotations

import math

from clipfinetune.report.summary import markdown_table

SUMMARY = "metrics/summary.json"
FIELDS = ("value", "baseline", "difference")


def mean_sd(values) -> dict:
    """{mean, sd, n} over the non-missing values (sd None below two)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "n": 0}
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": mean, "sd": sd, "n": len(vals)}


def aggregate(summaries: dict[str, dict]) -> dict:
    """summaries: {experiment name: metrics/summary.json dict}. Claims and headline cells are matched by name
    across experiments; one absent from some experiment counts only where present (its n says so)."""
    if not summaries:
        raise ValueError("no experiments to aggregate")
    runs = list(summaries.values())
    claims: dict = {}
    for method in dict.fromkeys(m for s in runs for m in s.get("claims", {})):
        for name in dict.fromkeys(n for s in runs for n in s["claims"].get(method, {})):
            found = [s["claims"][method][name] for s in runs if name in s["claims"].get(method, {})]
            entry = {f: mean_sd(c.get(f) for c in found) for f in FIELDS}
            entry["rule"] = found[0].get("rule")
            entry["verdicts"] = {v: sum(c.get("verdict") == v for c in found)
                                 for v in dict.fromkeys(c.get("verdict") for c in found)}
            claims.setdefault(method, {})[name] = entry
    headline: dict = {}
    for model in dict.fromkeys(m for s in runs for m in s.get("headline", {})):
        labels = dict.fromkeys(lbl for s in runs for lbl in s["headline"].get(model, {}))
        headline[model] = {lbl: mean_sd(s["headline"].get(model, {}).get(lbl) for s in runs) for lbl in labels}
    return {"experiments": list(summaries), "n_experiments": len(runs), "set": runs[0].get("set"),
            "claims": claims, "headline": headline}


def _ms(d: dict, signed: bool = False) -> str:
    if d["mean"] is None:
        return "–"
    m = f"{d['mean']:+.1f}" if signed else f"{d['mean']:.1f}"
    return m if d["sd"] is None else f"{m} ± {d['sd']:.1f}"


def render_markdown(agg: dict) -> str:
    names = ", ".join(f"`{e}`" for e in agg["experiments"])
    claims = [[method, name, c["rule"], _ms(c["value"]), _ms(c["baseline"]), _ms(c["difference"], True),
               ", ".join(f"{v} {n}" for v, n in c["verdicts"].items())]
              for method, cs in agg["claims"].items() for name, c in cs.items()]
    labels = list(dict.fromkeys(lbl for row in agg["headline"].values() for lbl in row))
    headline = [[model] + [_ms(row[lbl]) if lbl in row else "–" for lbl in labels]
                for model, row in agg["headline"].items()]
    lines = [f"# Seed spread ({agg['n_experiments']} experiments: {names}; set `{agg['set']}`)", "",
             "mean ± sd across experiments (sample sd). Verdicts: how many experiments gave each.", "",
             "## Claims", "",
             *markdown_table(["method", "claim", "rule", "value", "baseline", "difference", "verdicts"], claims),
             "", "## Headline metrics", "", *markdown_table(["model", *labels], headline)]
    return "\n".join(lines) + "\n"


def summaries_from_exp_show(rows: list, names=None) -> dict[str, dict]:
    """{experiment name: its metrics/summary.json} from `dvc exp show --json` output (the workspace and
    baseline commits are skipped; `names`, when given, keeps those experiments only, in that order).
    An experiment without a summary (failed, or still queued) is left out."""
    found: dict[str, dict] = {}
    for commit in rows:
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                name = rev.get("name") or exp.get("name") or rev.get("rev")
                data = (rev.get("data") or {}).get("metrics", {}).get(SUMMARY, {}).get("data")
                if data and not rev.get("error"):
                    found.setdefault(name, data)
    if names is None:
        return found
    return {n: found[n] for n in names if n in found}
