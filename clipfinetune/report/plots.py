"""Trade-off scatter plots across models (matplotlib Agg), from a `summary.summarize` summary.

* compositionality vs retrieval (FSC-CLIP Fig. 1): SugarCrepe mean vs mean of COCO-style R@1;
* box classification vs retrieval (HarmoCLIP Fig. 1): box top-1 vs mean R@1;
* long vs short retrieval: mean long-text R@1 vs mean short R@1.
A model without both numbers is left out of that plot.
"""
from __future__ import annotations

from pathlib import Path

from clipfinetune.io import atomic_path

PLOTS = {
    "compositionality_vs_retrieval": (("ret_i2t_r1", "ret_t2i_r1"), ("sugarcrepe",),
                                      "retrieval R@1 (mean I->T, T->I)", "SugarCrepe accuracy (mean of files)"),
    "box_cls_vs_retrieval": (("ret_i2t_r1", "ret_t2i_r1"), ("box_top1",),
                             "retrieval R@1 (mean I->T, T->I)", "box classification top-1"),
    "long_vs_short_retrieval": (("ret_i2t_r1", "ret_t2i_r1"), ("long_i2t_r1", "long_t2i_r1"),
                                "short retrieval R@1 (mean)", "long-text retrieval R@1 (mean)"),
}


def _mean(row, labels):
    vals = [row.get(lbl) for lbl in labels]
    return None if any(v is None for v in vals) else sum(vals) / len(vals)


def plot_points(summary: dict, xs, ys) -> list[tuple[str, float, float]]:
    pts = []
    for model, row in summary["headline"].items():
        x, y = _mean(row, xs), _mean(row, ys)
        if x is not None and y is not None:
            pts.append((model, x, y))
    return pts


def write_plots(summary: dict, out_dir) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name, (xs, ys, xlabel, ylabel) in PLOTS.items():
        pts = plot_points(summary, xs, ys)
        fig, ax = plt.subplots(figsize=(5.5, 4.2), dpi=110)
        for model, x, y in pts:
            marker = "s" if model in ("base", "clip") else "o"
            ax.scatter([x], [y], marker=marker, s=36)
            ax.annotate(model, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
        if not pts:
            ax.text(0.5, 0.5, "no model has both metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name.replace('_', ' ')} ({summary['set']})", fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = Path(out_dir) / f"{name}.png"
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
        plt.close(fig)
        written.append(str(path))
    return written
