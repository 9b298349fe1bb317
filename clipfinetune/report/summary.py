"""Cross-model summary: headline table with deltas vs `base` and `clip`, and the papers' CLAIMS checked
on the evaluated set (the sample world by default), each with a paired-bootstrap 95% CI of its difference.

A claim compares a method with a baseline model on one metric (or a mean of two). Its `difference` is
method - baseline in the metric's units (points); for `fsc_clip.lhn_keeps_retrieval` it is a difference of
differences (LHN-only's retrieval drop vs clip minus global-HN-only's). The CI resamples the test items of
every list the metric reads (`clipfinetune.report.bootstrap`: the same resamples for every model), recomputing
the metric per resample. Verdict:
  holds         the CI lies entirely on the claimed side: > 0 for "beats", < 0 for a smaller drop; for a
                "kept" claim (method within `margin` points of the baseline) the lower bound is > -margin;
  contradicted  the CI lies entirely on the other side (kept: the upper bound is < -margin);
  inconclusive  otherwise (the items cannot tell);
  saturated     both values >= 99: the benchmark cannot separate the models;
  missing       a model's metrics file, the metric, or its per-item outcomes are absent.
Works with any subset of models present.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clipfinetune.eval import items as item_stats
from clipfinetune.keys import lookup
from clipfinetune.report.bootstrap import LEVEL, RESAMPLES, paired_bootstrap

SATURATION = 99.0
RETRIEVAL_MARGIN = 2.0
VERDICTS = ("holds", "contradicted", "inconclusive", "saturated", "missing")


def headline_keys(s: str = "sample") -> dict[str, str]:
    """label -> dotted metric key."""
    return {
        "ret_i2t_r1": f"retrieval.{s}.i2t_r1", "ret_t2i_r1": f"retrieval.{s}.t2i_r1",
        "long_i2t_r1": f"long_retrieval.{s}.i2t_r1", "long_t2i_r1": f"long_retrieval.{s}.t2i_r1",
        "gl_i2t_map10": f"global_local.{s}.i2t_map10", "gl_t2i_map10": f"global_local.{s}.t2i_map10",
        "box_top1": f"box_cls.{s}.top1", "box_hard_top1": f"box_cls_hard.{s}.top1",
        "sugarcrepe": f"compositionality.sugarcrepe.{s}.mean",
        "vg_relation": f"compositionality.aro.{s}.vg_relation",
        "vg_attribution": f"compositionality.aro.{s}.vg_attribution",
        "coco_order": f"compositionality.aro.{s}.coco_order",
        "zs_acc1": f"zeroshot.{s}.acc1",
    }


def extra_zeroshot_keys(models: dict, s: str) -> dict[str, str]:
    """`zs_<set>_acc1` for every other zero-shot set a model was evaluated on (e.g. `zeroshot.shape`)."""
    sets = sorted({name for m in models.values() if m for name in (m.get("zeroshot") or {}) if name != s})
    return {f"zs_{name}_acc1": f"zeroshot.{name}.acc1" for name in sets}


def get(metrics: dict | None, key: str):
    """The number at dotted `key` of a metrics dict; None when absent or not a number."""
    node = lookup(metrics, key, None)
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def load_metrics(paths: dict[str, str | Path]) -> dict[str, dict | None]:
    """{model: metrics dict, or None when its file does not exist}."""
    return {m: json.loads(Path(p).read_text()) if Path(p).is_file() else None for m, p in paths.items()}


def load_items(paths: dict[str, str | Path]) -> dict:
    """{model: per-item table (eval@<model>'s parquet), or None when its file does not exist}."""
    import pandas as pd

    return {m: pd.read_parquet(p) if Path(p).is_file() else None for m, p in paths.items()}


def _keys(metric: str) -> list[str]:
    """A metric key, or the keys of `mean(<k1>,<k2>)`."""
    return [k.strip() for k in metric[5:-1].split(",")] if metric.startswith("mean(") else [metric]


def _derived(metrics: dict | None, metric: str):
    values = [get(metrics, k) for k in _keys(metric)]
    return None if any(v is None for v in values) else sum(values) / len(values)


@dataclass(frozen=True)
class Claim:
    """`method` vs `baseline` on `metric`. side ">": method higher; "kept": method >= baseline - margin;
    "<drop": method's drop from `reference` smaller than baseline's (a difference of differences)."""
    method: str
    metric: str
    baseline: str
    side: str = ">"
    margin: float = 0.0
    reference: str | None = None

    @property
    def rule(self) -> str:
        if self.side == "<drop":
            return f"{self.method} drop < {self.baseline} drop (vs {self.reference})"
        if self.side == "kept":
            return f"{self.method} >= {self.baseline} - {self.margin:g}" if self.margin else \
                f"{self.method} >= {self.baseline} (margin 0)"
        return f"{self.method} > {self.baseline}"

    @property
    def models(self) -> tuple[str, ...]:
        return (self.method, self.baseline) + ((self.reference,) if self.reference else ())


def claim_specs(s: str = "sample") -> dict[str, dict[str, Claim]]:
    ret, sc = f"retrieval.{s}.i2t_r1", f"compositionality.sugarcrepe.{s}.mean"
    long_t2i = f"long_retrieval.{s}.t2i_r1"
    long_mean = f"mean(long_retrieval.{s}.t2i_r1,long_retrieval.{s}.i2t_r1)"
    kept = {"side": "kept", "margin": RETRIEVAL_MARGIN}
    return {
        "harmoclip": {"box_cls_beats_clip": Claim("harmoclip", f"box_cls.{s}.top1", "clip"),
                      "retrieval_kept": Claim("harmoclip", ret, "clip", **kept)},
        "fsc_clip": {"sugarcrepe_beats_clip": Claim("fsc_clip", sc, "clip"),
                     "retrieval_kept": Claim("fsc_clip", ret, "clip", **kept),
                     # FSC-CLIP: LHN-only keeps i2t R@1 closer to clip than global-HN-only (smaller drop)
                     "lhn_keeps_retrieval": Claim("fsc_lhn_only", ret, "fsc_global_only", "<drop", reference="clip")},
        "goal": {"long_t2i_beats_global_only": Claim("goal", long_t2i, "goal_global_only"),
                 "long_t2i_beats_clip": Claim("goal", long_t2i, "clip")},
        # DeGLA: distillation keeps zero-shot, i.e. the run without it scores lower (margin 0)
        "degla": {"sugarcrepe_beats_clip": Claim("degla", sc, "clip"),
                  "zeroshot_kept_vs_no_distill": Claim("degla", f"zeroshot.{s}.acc1", "degla_no_distill", "kept")},
        "mulclip": {"long_r1_beats_global_only": Claim("mulclip", long_mean, "mulclip_global_only"),
                    "long_r1_beats_clip": Claim("mulclip", long_mean, "clip"),
                    "retrieval_kept": Claim("mulclip", ret, "clip", **kept)},
    }


def verdict(low: float, high: float, side: str, margin: float = 0.0) -> str:
    """The CI [low, high] of the difference against the claimed side (see the module docstring)."""
    if side == ">":
        return "holds" if low > 0 else "contradicted" if high < 0 else "inconclusive"
    if side == "<drop":
        return "holds" if high < 0 else "contradicted" if low > 0 else "inconclusive"
    if side == "kept":
        return "holds" if low > -margin else "contradicted" if high < -margin else "inconclusive"
    raise ValueError(f"unknown claim side {side!r}")


def _statistic(metric: str, parts: dict) -> tuple[list, callable]:
    """The metric (or mean of metrics) as parts read + fn(model parts, {part: idx}) -> values."""
    stats = [item_stats.statistic(k, parts) for k in _keys(metric)]
    keys = list(dict.fromkeys(k for st in stats for k in st.parts))
    return keys, lambda p, idx: np.mean([st.fn(p, idx) for st in stats], axis=0)


def _aligned(claim: Claim, parts: dict, keys: list) -> None:
    """Pairing needs the same items in every model (same sets evaluated)."""
    first = parts[claim.method]
    for m in claim.models[1:]:
        for k in keys:
            if k not in parts[m] or not np.array_equal(first[k].ids, parts[m][k].ids):
                raise ValueError(f"claim {claim.rule}: {m} and {claim.method} were scored on different items of {k}")


def check_claim(claim: Claim, metrics: dict, parts: dict, n_resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """metrics: {model: metrics dict | None}; parts: {model: items.parts_of(table) | None}."""
    out = {"metric": claim.metric if claim.side != "<drop" else f"drop of {claim.metric} vs {claim.reference}",
           "rule": claim.rule, "value": None, "baseline": None, "difference": None, "ci_low": None,
           "ci_high": None, "verdict": "missing"}
    raw = {m: _derived(metrics.get(m), claim.metric) for m in claim.models}
    if any(v is None for v in raw.values()):
        return out
    if claim.side == "<drop":
        ref = raw[claim.reference]
        out.update(value=ref - raw[claim.method], baseline=ref - raw[claim.baseline])
    else:
        out.update(value=raw[claim.method], baseline=raw[claim.baseline])
    out["difference"] = out["value"] - out["baseline"]
    if any(parts.get(m) is None for m in claim.models):
        return out
    try:
        keys, fn = _statistic(claim.metric, parts[claim.method])
    except KeyError:
        return out
    _aligned(claim, parts, keys)
    sizes = {k: len(parts[claim.method][k].ids) for k in keys}

    def difference(idx):
        idx = {k: idx["/".join(k)] for k in keys}
        if claim.side == "<drop":     # (ref - method) - (ref - baseline): the reference cancels item by item
            return fn(parts[claim.baseline], idx) - fn(parts[claim.method], idx)
        return fn(parts[claim.method], idx) - fn(parts[claim.baseline], idx)
    ci = paired_bootstrap({"/".join(k): n for k, n in sizes.items()}, difference, n_resamples, seed)
    if abs(ci["estimate"] - out["difference"]) > 1e-6:
        raise ValueError(f"claim {claim.rule}: per-item outcomes give {ci['estimate']:.6f}, the metrics files "
                         f"{out['difference']:.6f} (stale items or metrics file?)")
    out.update(ci_low=ci["low"], ci_high=ci["high"])
    both_high = min(raw[claim.method], raw[claim.baseline]) >= SATURATION
    out["verdict"] = "saturated" if both_high else verdict(ci["low"], ci["high"], claim.side, claim.margin)
    return out


def claims(models: dict, s: str = "sample", items: dict | None = None, n_resamples: int = RESAMPLES,
           seed: int = 0) -> dict:
    """{method: {claim name: {metric, rule, value, baseline, difference, ci_low, ci_high, verdict}}}.
    models: {model: metrics dict | None}; items: {model: per-item table | None}."""
    parts = {m: (item_stats.parts_of(t) if t is not None else None) for m, t in (items or {}).items()}
    return {method: {name: check_claim(c, models, parts, n_resamples, seed) for name, c in cs.items()}
            for method, cs in claim_specs(s).items()}


def paper_rows(paper: dict, models: dict[str, dict | None]) -> dict:
    """A paper's own numbers beside ours: `paper` is one entry of recipes/paper_numbers.yaml ({paper, models: {model:
    [{metric, value, source}]}, not_listed}); per listed metric: the paper's value, ours (None if not evaluated) and
    the gap ours - paper in points."""
    rows = []
    for model, entries in (paper.get("models") or {}).items():
        for e in entries:
            ours = get(models.get(model), e["metric"])
            rows.append({"model": model, "metric": e["metric"], "paper": float(e["value"]), "ours": ours,
                         "gap": None if ours is None else ours - float(e["value"]), "source": e["source"]})
    return {"paper": paper.get("paper", ""), "not_listed": paper.get("not_listed", ""), "rows": rows}


def summarize(models: dict[str, dict | None], s: str = "sample", items: dict | None = None,
              n_resamples: int = RESAMPLES, seed: int = 0, paper: dict | None = None) -> dict:
    """models: {model: metrics dict | None}; items: {model: per-item table | None} (no items: no CIs); paper: one
    entry of recipes/paper_numbers.yaml, shown beside ours (`paper_rows`), or None."""
    keys = {**headline_keys(s), **extra_zeroshot_keys(models, s)}
    present = {m: v for m, v in models.items() if v is not None}
    table = {m: {lbl: get(v, k) for lbl, k in keys.items()} for m, v in present.items()}

    def deltas(ref):
        if ref not in table:
            return {}
        return {m: {lbl: (None if row[lbl] is None or table[ref][lbl] is None else row[lbl] - table[ref][lbl])
                    for lbl in keys} for m, row in table.items() if m != ref}
    return {"set": s, "headline": table, "delta_vs_base": deltas("base"), "delta_vs_clip": deltas("clip"),
            "missing_models": sorted(m for m, v in models.items() if v is None),
            "missing_items": sorted(m for m in present if (items or {}).get(m) is None),
            "bootstrap": {"n_resamples": n_resamples, "seed": seed, "level": LEVEL},
            "claims": claims(models, s, items, n_resamples, seed),
            **({"paper": paper_rows(paper, models)} if paper else {})}


def _fmt(v, signed=False):
    if v is None:
        return "–"
    return f"{v:+.1f}" if signed else f"{v:.1f}"


def _ci(c: dict) -> str:
    return "–" if c.get("ci_low") is None else f"[{c['ci_low']:+.1f}, {c['ci_high']:+.1f}]"


def claim_rows(summary: dict) -> list[list[str]]:
    """method, claim, rule, value, baseline, difference, CI, verdict per claim (strings)."""
    return [[method, name, c["rule"], _fmt(c["value"]), _fmt(c["baseline"]), _fmt(c["difference"], True), _ci(c),
             c["verdict"]] for method, cs in summary["claims"].items() for name, c in cs.items()]


VERDICT_NOTE = ("Difference = method - baseline in points (for `lhn_keeps_retrieval`: LHN-only's drop minus "
                "global-HN-only's); CI = {level:.0f}% paired-bootstrap percentile interval over the test items "
                "({n} resamples, the same for every model). `holds`: the CI lies on the claimed side of 0 (kept "
                "claims: lower bound > -margin); `contradicted`: on the other side; `inconclusive`: it straddles; "
                "`saturated`: both values >= 99; `missing`: a model, metric or its per-item outcomes are absent.")


# What the sample world cannot show, one line each, where users read results (README "Known limitations" says the
# same). A number measured in a research record names that record; a number of the runs printed above comes from
# this summary, so the line never quotes another run's results as this one's.
SAMPLE_WORLD_SET = "sample"
BINDING_LIMITATION = (
    "The sample world cannot measure binding: the oracle fine-tune of docs/research/binding-headroom.md, with "
    "ground-truth swap negatives, stays at chance (swap_att 48.8, swap_obj 48.3; its base 52.0 / 49.5; chance 50), "
    "so the compositional claims are inconclusive for the world's sake, not the method's.")
MULCLIP_RECORD = (
    "In the runs of docs/research/mulclip-terms.md the local terms lost (long R@1 37.3 against 53.0): in about 30 "
    "steps from a from-scratch base their gradients, as large as L_global's and not aligned with it, leave the "
    "clipped step 53% of the global direction, and 46.4% of L_Sub's rows hold a false negative among the templated "
    "descriptions.")
MULCLIP_CLAIM = ("mulclip", "long_r1_beats_global_only")


def mulclip_limitation(summary: dict) -> str:
    """MulCLIP's line: this summary's own long R@1 of `mulclip` and its baseline (as the claims table prints them),
    where it has them, then the research record's numbers under the record's name."""
    method, name = MULCLIP_CLAIM
    claim = summary.get("claims", {}).get(method, {}).get(name)
    if claim is None or claim.get("value") is None or claim.get("baseline") is None:
        return f"MulCLIP's local terms on this world: {MULCLIP_RECORD[0].lower()}{MULCLIP_RECORD[1:]}"
    return (f"MulCLIP's local terms on this world: here mulclip scores {_fmt(claim['value'])} against "
            f"{_fmt(claim['baseline'])} for {claim_specs()[method][name].baseline} on long R@1 (the mean of both "
            f"directions; {name}: {claim['verdict']}). {MULCLIP_RECORD}")


def limitations(summary: dict) -> tuple[str, ...]:
    """The lines that qualify this summary's claims: the sample world's, on its own set; none on a real set."""
    if summary.get("set") != SAMPLE_WORLD_SET:
        return ()
    return BINDING_LIMITATION, mulclip_limitation(summary)


def render_markdown(summary: dict, plots: list[str] = ()) -> str:
    labels = list(next(iter(summary["headline"].values()), {})) or list(headline_keys(summary["set"]))
    rows = []
    for m, row in summary["headline"].items():
        db, dc = summary["delta_vs_base"].get(m, {}), summary["delta_vs_clip"].get(m, {})
        rows.append([m] + [f"{_fmt(row[lbl])} ({_fmt(db.get(lbl), True)} / {_fmt(dc.get(lbl), True)})"
                           if row[lbl] is not None else "–" for lbl in labels])
    lines = [f"# Evaluation summary (set `{summary['set']}`)", "",
             "Each cell: value (Δ vs `base` / Δ vs `clip`), percent. – = not evaluated.", "",
             *markdown_table(["model", *labels], rows)]
    if summary["missing_models"]:
        lines += ["", "Missing metrics files: " + ", ".join(f"`{m}`" for m in summary["missing_models"])]
    if summary.get("missing_items"):
        lines += ["", "Missing per-item outcomes (no CI): " + ", ".join(f"`{m}`" for m in summary["missing_items"])]
    lines += ["", "## Claims (each paper's headline on this set)", "",
              *markdown_table(["method", "claim", "rule", "value", "baseline", "difference", "95% CI", "verdict"],
                              claim_rows(summary))]
    boot = summary.get("bootstrap", {"level": LEVEL, "n_resamples": RESAMPLES})
    lines += ["", VERDICT_NOTE.format(level=100 * boot["level"], n=boot["n_resamples"])]
    if limitations(summary):
        lines += ["", "## Known limitations of the sample world", ""] + [f"- {line}" for line in limitations(summary)]
    if summary.get("paper"):
        p = summary["paper"]
        lines += ["", f"## The paper's numbers beside ours: {p['paper']}", "",
                  "Gap = ours - paper, points. – = not evaluated here.", "",
                  *markdown_table(["model", "metric", "paper", "ours", "gap", "source"], paper_table(p))]
        if p.get("not_listed"):
            lines += ["", f"Not listed: {p['not_listed']}"]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def paper_table(paper: dict) -> list[list[str]]:
    """model, metric, paper, ours, gap, source per row of `paper_rows` (strings)."""
    return [[r["model"], r["metric"], _fmt(r["paper"]), _fmt(r["ours"]), _fmt(r["gap"], True), r["source"]]
            for r in paper["rows"]]


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-markdown table's lines (the summary's and the seed spread's)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def render_text(summary: dict) -> str:
    """The terminal view `make run` ends with: headline values (no deltas; columns no model has are left out)
    and the claims with CIs."""
    rows = summary["headline"].values()
    labels = [lbl for lbl in next(iter(rows), {}) if any(row.get(lbl) is not None for row in rows)]
    head = _table(["model"] + labels,
                  [[m] + [_fmt(row[lbl]) for lbl in labels] for m, row in summary["headline"].items()])
    claim = _table(["method", "claim", "rule", "value", "baseline", "diff", "95% CI", "verdict"], claim_rows(summary))
    counts = {v: sum(r[-1] == v for r in claim_rows(summary)) for v in VERDICTS}
    tally = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    paper = []
    if summary.get("paper"):
        paper = ["", f"The paper's numbers beside ours ({summary['paper']['paper']}; gap = ours - paper)", ""] + \
            _table(["model", "metric", "paper", "ours", "gap", "source"], paper_table(summary["paper"]))
    limits = ["", "Known limitations of the sample world:"] + [f"- {line}" for line in limitations(summary)] \
        if limitations(summary) else []
    return "\n".join([f"Evaluation summary, set '{summary['set']}' (percent; details: reports/summary.md)", ""]
                      + head + ["", f"Claims ({tally})", ""] + claim + limits + paper) + "\n"


if __name__ == "__main__":      # python -m clipfinetune.report.summary [metrics/summary.json]
    import sys

    print(render_text(json.loads(Path(sys.argv[1] if len(sys.argv) > 1 else "metrics/summary.json").read_text())),
          end="")
