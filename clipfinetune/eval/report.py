"""Cross-model summary: headline table with deltas vs `base` and `clip`, and the papers' CLAIMS checked
on the evaluated set (the sample world by default).

A claim's `holds` is True / False, "saturated" (the compared values are equal, or both >= 99: the
benchmark cannot separate them) or "missing" (a model's metrics file or the metric is absent).
Works with any subset of models present.
"""
from __future__ import annotations

import json
from pathlib import Path

SATURATION = 99.0
RETRIEVAL_MARGIN = 2.0


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


def get(metrics: dict | None, key: str):
    node = metrics
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def load_metrics(paths: dict[str, str | Path]) -> dict[str, dict | None]:
    """{model: metrics dict, or None when its file does not exist}."""
    return {m: json.loads(Path(p).read_text()) if Path(p).is_file() else None for m, p in paths.items()}


def _mean(values):
    return None if any(v is None for v in values) else sum(values) / len(values)


def _derived(metrics: dict | None, metric: str):
    """A metric key, or `mean(<k1>,<k2>)` of two keys."""
    if metric.startswith("mean("):
        return _mean([get(metrics, k.strip()) for k in metric[5:-1].split(",")])
    return get(metrics, metric)


def _verdict(value, baseline, ok: bool, a=None, b=None):
    """saturated when the compared raw values are equal or both >= 99."""
    a, b = (value, baseline) if a is None else (a, b)
    if a == b or (a >= SATURATION and b >= SATURATION):
        return "saturated"
    return bool(ok)


def compare_claim(models: dict, method: str, metric: str, other: str, rule: str) -> dict:
    """rule: ">" (method beats other) or ">=-2" (method within 2 points of other)."""
    value, ref = _derived(models.get(method), metric), _derived(models.get(other), metric)
    text = f"{method} > {other}" if rule == ">" else f"{method} >= {other} - {RETRIEVAL_MARGIN:g}"
    out = {"metric": metric, "rule": text, "value": value, "baseline": ref}
    if value is None or ref is None:
        return {**out, "holds": "missing"}
    ok = value > ref if rule == ">" else value >= ref - RETRIEVAL_MARGIN
    return {**out, "holds": _verdict(value, ref, ok)}


def lhn_claim(models: dict, s: str) -> dict:
    """FSC-CLIP: LHN-only keeps i2t R@1 closer to clip than global-HN-only (smaller drop)."""
    key = f"retrieval.{s}.i2t_r1"
    clip, lhn, glob = (get(models.get(m), key) for m in ("clip", "fsc_lhn_only", "fsc_global_only"))
    out = {"metric": f"drop of {key} vs clip", "rule": "fsc_lhn_only drop < fsc_global_only drop"}
    if None in (clip, lhn, glob):
        return {**out, "value": None, "baseline": None, "holds": "missing"}
    d_lhn, d_glob = clip - lhn, clip - glob
    return {**out, "value": d_lhn, "baseline": d_glob, "holds": _verdict(d_lhn, d_glob, d_lhn < d_glob, lhn, glob)}


def claims(models: dict, s: str = "sample") -> dict:
    ret, sc = f"retrieval.{s}.i2t_r1", f"compositionality.sugarcrepe.{s}.mean"
    long_t2i = f"long_retrieval.{s}.t2i_r1"
    long_mean = f"mean(long_retrieval.{s}.t2i_r1,long_retrieval.{s}.i2t_r1)"
    return {
        "harmoclip": {"box_cls_beats_clip": compare_claim(models, "harmoclip", f"box_cls.{s}.top1", "clip", ">"),
                      "retrieval_kept": compare_claim(models, "harmoclip", ret, "clip", ">=-2")},
        "fsc_clip": {"sugarcrepe_beats_clip": compare_claim(models, "fsc_clip", sc, "clip", ">"),
                     "retrieval_kept": compare_claim(models, "fsc_clip", ret, "clip", ">=-2"),
                     "lhn_keeps_retrieval": lhn_claim(models, s)},
        "goal": {"long_t2i_beats_global_only": compare_claim(models, "goal", long_t2i, "goal_global_only", ">"),
                 "long_t2i_beats_clip": compare_claim(models, "goal", long_t2i, "clip", ">")},
        "degla": {"sugarcrepe_beats_clip": compare_claim(models, "degla", sc, "clip", ">"),
                  "zeroshot_kept_vs_no_distill": _ge(models, "degla", f"zeroshot.{s}.acc1", "degla_no_distill")},
        "mulclip": {"long_r1_beats_global_only": compare_claim(models, "mulclip", long_mean, "mulclip_global_only", ">"),
                    "long_r1_beats_clip": compare_claim(models, "mulclip", long_mean, "clip", ">"),
                    "retrieval_kept": compare_claim(models, "mulclip", ret, "clip", ">=-2")},
    }


def _ge(models, method, metric, other):
    """method >= other (no margin): DeGLA's distillation keeps zero-shot at least as high."""
    c = compare_claim(models, method, metric, other, ">")
    c["rule"] = f"{method} >= {other}"
    if c["holds"] not in ("missing", "saturated"):
        c["holds"] = c["value"] >= c["baseline"]
    return c


def summarize(models: dict[str, dict | None], s: str = "sample") -> dict:
    keys = headline_keys(s)
    present = {m: v for m, v in models.items() if v is not None}
    table = {m: {lbl: get(v, k) for lbl, k in keys.items()} for m, v in present.items()}

    def deltas(ref):
        if ref not in table:
            return {}
        return {m: {lbl: (None if row[lbl] is None or table[ref][lbl] is None else row[lbl] - table[ref][lbl])
                    for lbl in keys} for m, row in table.items() if m != ref}
    return {"set": s, "headline": table, "delta_vs_base": deltas("base"), "delta_vs_clip": deltas("clip"),
            "missing_models": sorted(m for m, v in models.items() if v is None),
            "claims": claims(models, s)}


def _fmt(v, signed=False):
    if v is None:
        return "–"
    return f"{v:+.1f}" if signed else f"{v:.1f}"


def render_markdown(summary: dict, plots: list[str] = ()) -> str:
    labels = list(headline_keys(summary["set"]))
    lines = [f"# Evaluation summary (set `{summary['set']}`)", "",
             "Each cell: value (Δ vs `base` / Δ vs `clip`), percent. – = not evaluated.", "",
             "| model | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for m, row in summary["headline"].items():
        db, dc = summary["delta_vs_base"].get(m, {}), summary["delta_vs_clip"].get(m, {})
        cells = [f"{_fmt(row[lbl])} ({_fmt(db.get(lbl), True)} / {_fmt(dc.get(lbl), True)})"
                 if row[lbl] is not None else "–" for lbl in labels]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if summary["missing_models"]:
        lines += ["", "Missing metrics files: " + ", ".join(f"`{m}`" for m in summary["missing_models"])]
    lines += ["", "## Claims (each paper's headline on this set)", "",
              "| method | claim | rule | metric | value | baseline | holds |", "|---|---|---|---|---|---|---|"]
    for method, cs in summary["claims"].items():
        for name, c in cs.items():
            lines.append(f"| {method} | {name} | {c['rule']} | `{c['metric']}` | {_fmt(c['value'])} | "
                         f"{_fmt(c['baseline'])} | {c['holds']} |")
    lines += ["", "`saturated`: the compared values are equal or both >= 99, so the benchmark cannot tell them apart."]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"
