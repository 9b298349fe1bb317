"""Report: claims with paired-bootstrap CIs and verdicts (holds / contradicted / inconclusive / saturated /
missing) and rendering, from tiny metrics files and per-item tables built by hand."""
import json

import numpy as np
import pytest

from clipfinetune.eval.items import Items, to_frame
from clipfinetune.report import plots
from clipfinetune.report import summary as report

N = 40
HALF = np.tile([1.0, 0.0], N // 2)                 # every other item right: 50%


def model(ret=HALF, t2i=HALF, long_t2i=HALF, long_i2t=HALF, box=HALF, sc=(HALF, HALF[:10]), zs=HALF):
    """(metrics dict, item table) of a model from per-item outcomes: `ret`/`t2i`/`long_*` 1.0 = rank 1 (hit),
    0.0 = rank 2; `box`/`zs` top-1 hits; `sc` the hits of two SugarCrepe files (sizes 40 and 10)."""
    ret, t2i, long_t2i, long_i2t, box, zs = (np.asarray(a, dtype=float)
                                             for a in (ret, t2i, long_t2i, long_i2t, box, zs))
    ids = [f"{i:03d}" for i in range(N)]
    rows = [("retrieval.sample", Items("i2t", "rank", ids, 2 - ret)),
            ("retrieval.sample", Items("t2i", "rank", ids, 2 - t2i)),
            ("long_retrieval.sample", Items("i2t", "rank", ids, 2 - long_i2t)),
            ("long_retrieval.sample", Items("t2i", "rank", ids, 2 - long_t2i)),
            ("box_cls.sample", Items("top1", "correct", ids, box, ["0:circle"] * N)),
            ("zeroshot.sample", Items("top1", "correct", ids, zs, ["0:circle"] * N))]
    rows += [("compositionality.sugarcrepe.sample", Items(f"file{k}", "correct", ids[:len(s)], s))
             for k, s in enumerate(sc)]
    def pct(a):                                     # what the eval stage reports
        return 100.0 * float(np.mean(a))
    metrics = {"retrieval": {"sample": {"i2t_r1": pct(ret), "t2i_r1": pct(t2i)}},
               "long_retrieval": {"sample": {"t2i_r1": pct(long_t2i), "i2t_r1": pct(long_i2t)}},
               "box_cls": {"sample": {"top1": pct(box)}},
               "compositionality": {"sugarcrepe": {"sample": {"mean": (pct(sc[0]) + pct(sc[1])) / 2}}},
               "zeroshot": {"sample": {"acc1": pct(zs)}}, "skipped": {}}
    return metrics, to_frame(rows)


def claims_of(**models):
    return report.claims({m: v[0] for m, v in models.items()}, items={m: v[1] for m, v in models.items()})


ALL, NONE = np.ones(N), np.zeros(N)
WORSE_ON_SOME = HALF.copy()
WORSE_ON_SOME[:8:2] = 0.0                          # 4 of the 20 hits lost: -10 points


def test_better_on_every_item_holds_worse_is_contradicted_identical_inconclusive():
    c = claims_of(clip=model(), harmoclip=model(box=ALL), degla=model(sc=(NONE, NONE[:10])),
                  fsc_clip=model())
    box = c["harmoclip"]["box_cls_beats_clip"]
    assert (box["value"], box["baseline"], box["difference"]) == (100.0, 50.0, 50.0)
    assert box["ci_low"] > 0 and box["verdict"] == "holds"
    worse = c["degla"]["sugarcrepe_beats_clip"]
    assert worse["difference"] == -50.0 and worse["ci_high"] < 0 and worse["verdict"] == "contradicted"
    same = c["fsc_clip"]["sugarcrepe_beats_clip"]
    assert (same["difference"], same["ci_low"], same["ci_high"]) == (0.0, 0.0, 0.0)
    assert same["verdict"] == "inconclusive"


def test_kept_claims_use_the_margin():
    # identical retrieval -> CI [0, 0], inside the 2-point margin -> holds; losing 4 of 40 hits (-10) ->
    # contradicted; losing 1 of 40 (-2.5: CI reaches below -2 and above it) -> inconclusive
    one_lost = HALF.copy()
    one_lost[0] = 0.0
    c = claims_of(clip=model(), harmoclip=model(box=ALL), fsc_clip=model(ret=WORSE_ON_SOME),
                  mulclip=model(ret=one_lost))
    assert c["harmoclip"]["retrieval_kept"]["verdict"] == "holds"
    fsc = c["fsc_clip"]["retrieval_kept"]
    assert fsc["difference"] == pytest.approx(-10.0) and fsc["ci_high"] < -2.0 and fsc["verdict"] == "contradicted"
    mul = c["mulclip"]["retrieval_kept"]
    assert mul["ci_low"] < -2.0 < mul["ci_high"] and mul["verdict"] == "inconclusive"


def test_a_mean_of_files_resamples_each_file_and_recomputes_the_mean():
    # file 0 (40 cases) identical to clip; file 1 (10 cases) right everywhere instead of every other one:
    # mean difference = (0 + 50) / 2 = 25; every resample of file 1 keeps 0 <= diff, so CI within [0, 50]
    c = claims_of(clip=model(), fsc_clip=model(sc=(HALF, ALL[:10])))["fsc_clip"]["sugarcrepe_beats_clip"]
    assert c["difference"] == pytest.approx(25.0)
    assert 0.0 < c["ci_low"] < 25.0 < c["ci_high"] <= 50.0 and c["verdict"] == "holds"


def test_lhn_claim_is_a_difference_of_differences_on_the_same_resamples():
    # drop vs clip: lhn_only loses nothing, global_only loses 4 hits (10 points) -> difference -10
    c = claims_of(clip=model(), fsc_lhn_only=model(), fsc_global_only=model(ret=WORSE_ON_SOME))
    lhn = c["fsc_clip"]["lhn_keeps_retrieval"]
    assert (lhn["value"], lhn["baseline"], lhn["difference"]) == (0.0, pytest.approx(10.0), pytest.approx(-10.0))
    assert lhn["ci_high"] < 0 and lhn["verdict"] == "holds"
    flipped = claims_of(clip=model(), fsc_lhn_only=model(ret=WORSE_ON_SOME), fsc_global_only=model())
    assert flipped["fsc_clip"]["lhn_keeps_retrieval"]["verdict"] == "contradicted"


def test_mean_of_two_long_retrieval_directions():
    c = claims_of(clip=model(), mulclip=model(long_t2i=ALL))["mulclip"]["long_r1_beats_clip"]
    assert (c["value"], c["baseline"]) == (75.0, 50.0) and c["verdict"] == "holds"


def test_saturated_missing_and_stale_items():
    c = claims_of(goal=model(long_t2i=ALL), goal_global_only=model(long_t2i=ALL))
    assert c["goal"]["long_t2i_beats_global_only"]["verdict"] == "saturated"
    assert c["goal"]["long_t2i_beats_clip"]["verdict"] == "missing"             # no clip at all
    # metrics present, per-item table absent: values, no CI
    m, _ = model(box=ALL)
    c = report.claims({"clip": model()[0], "harmoclip": m}, items={"clip": model()[1], "harmoclip": None})
    box = c["harmoclip"]["box_cls_beats_clip"]
    assert box["difference"] == 50.0 and box["ci_low"] is None and box["verdict"] == "missing"
    # a metric absent from a metrics file
    m, t = model()
    del m["box_cls"]
    assert claims_of(clip=model(), harmoclip=(m, t))["harmoclip"]["box_cls_beats_clip"]["verdict"] == "missing"
    # items that disagree with the metrics file are an error, not a silent CI
    m, _ = model(box=ALL)
    with pytest.raises(ValueError, match="stale"):
        report.claims({"clip": model()[0], "harmoclip": m}, items={"clip": model()[1], "harmoclip": model()[1]})


def test_verdict_rules():
    assert report.verdict(0.1, 3.0, ">") == "holds"
    assert report.verdict(-3.0, -0.1, ">") == "contradicted"
    assert report.verdict(-0.1, 3.0, ">") == "inconclusive"
    assert report.verdict(-1.9, 1.0, "kept", 2.0) == "holds"
    assert report.verdict(-2.1, 1.0, "kept", 2.0) == "inconclusive"
    assert report.verdict(-5.0, -2.1, "kept", 2.0) == "contradicted"
    assert report.verdict(-3.0, -0.1, "<drop") == "holds"
    assert report.verdict(0.1, 3.0, "<drop") == "contradicted"


def test_report_renders_from_tiny_files_with_only_base_and_clip(tmp_path):
    from clipfinetune.io import write_parquet
    for name, (m, t) in {"base": model(ret=NONE), "clip": model()}.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(m))
        write_parquet(tmp_path / f"{name}.parquet", t)
    names = ("base", "clip", "harmoclip")
    s = report.summarize(report.load_metrics({m: tmp_path / f"{m}.json" for m in names}), "sample",
                         report.load_items({m: tmp_path / f"{m}.parquet" for m in names}))
    assert s["missing_models"] == ["harmoclip"] and s["missing_items"] == []
    assert s["headline"]["clip"]["ret_i2t_r1"] == 50.0 and s["headline"]["clip"]["gl_i2t_map10"] is None
    assert s["delta_vs_base"]["clip"]["ret_i2t_r1"] == pytest.approx(50.0)
    assert s["delta_vs_clip"]["base"]["ret_i2t_r1"] == pytest.approx(-50.0)
    assert s["claims"]["harmoclip"]["box_cls_beats_clip"]["verdict"] == "missing"
    written = plots.write_plots(s, tmp_path)
    assert len(written) == 3 and all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in written)
    assert [m for m, _, _ in plots.plot_points(s, ("ret_i2t_r1",), ("box_top1",))] == ["base", "clip"]
    md = report.render_markdown(s, written)
    assert "| clip | 50.0 (+50.0 / –)" in md
    assert "| harmoclip | box_cls_beats_clip | harmoclip > clip | – | – | – | – | missing |" in md
    text = report.render_text(s)
    assert "Claims (12 missing)" in text and "box_cls_beats_clip" in text and "(+" not in text
    assert "ret_i2t_r1" in text and "gl_i2t_map10" not in text     # a column no model has is left out
    json.dumps(s)                                  # serialisable as the DVC metrics file


def test_other_zeroshot_sets_join_the_headline():
    m, t = model()
    m["zeroshot"]["shape"] = {"acc1": 91.0}
    s = report.summarize({"base": m}, "sample", {"base": t})
    assert s["headline"]["base"]["zs_shape_acc1"] == 91.0
    assert "zs_shape_acc1" in report.render_markdown(s)


def test_the_papers_numbers_stand_beside_ours_with_the_gap():
    """A recipe's paper (recipes/paper_numbers.yaml shape): per metric the paper's value, ours and ours - paper."""
    paper = {"paper": "DeGLA, ViT-B/32", "not_listed": "VALSE counting",
             "models": {"degla": [{"metric": "compositionality.aro.real.vg_relation", "value": 81.6,
                                   "source": "Table 4, row DeGLA, Relation"},
                                  {"metric": "compositionality.valse.real.existence", "value": 82.4,
                                   "source": "Table 2, row DeGLA, Existence"}],
                        "base": [{"metric": "compositionality.aro.real.vg_relation", "value": 59.2,
                                  "source": "Table 4, row CLIP, Relation"}]}}
    models = {"base": {"compositionality": {"aro": {"real": {"vg_relation": 60.0}}}},
              "degla": {"compositionality": {"aro": {"real": {"vg_relation": 79.1}}}}}
    summary = report.summarize(models, "real", paper=paper)
    rows = {(r["model"], r["metric"].rsplit(".", 1)[-1]): r for r in summary["paper"]["rows"]}
    assert rows[("degla", "vg_relation")]["gap"] == pytest.approx(79.1 - 81.6)
    assert rows[("base", "vg_relation")]["gap"] == pytest.approx(60.0 - 59.2)
    assert rows[("degla", "existence")]["ours"] is None and rows[("degla", "existence")]["gap"] is None
    md = report.render_markdown(summary)
    assert "## The paper's numbers beside ours: DeGLA, ViT-B/32" in md
    assert "| degla | compositionality.aro.real.vg_relation | 81.6 | 79.1 | -2.5 | Table 4, row DeGLA, Relation |" in md
    assert "| degla | compositionality.valse.real.existence | 82.4 | – | – |" in md
    assert "Not listed: VALSE counting" in md
    assert "-2.5" in report.render_text(summary)
    assert "paper" not in report.summarize(models, "real")          # no recipe paper: no section


def test_editing_the_report_re_runs_report_alone():
    """clipfinetune/report is a dependency of stage `report` only, and needs nothing of clipfinetune/eval beyond
    the declared items.py: a claim or plot edit must not re-run the 13 eval@ stages (nor leave `report` stale)."""
    import ast
    from pathlib import Path

    import yaml

    from clipfinetune.project.deps import closure, expected_code_dep, stage_closure, stage_script

    root = Path(__file__).resolve().parents[1]
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    # the report modules stage `report` imports (clipfinetune/report/seeds.py is stages/seeds.py's, outside the DAG)
    report_files = [f for f in closure("stages/report.py") if f.startswith("clipfinetune/report/")]
    assert "clipfinetune/report/summary.py" in report_files

    def covers(dep: str, f: str) -> bool:
        return f == dep or f.startswith(dep.rstrip("/") + "/")

    def code(body: dict) -> list[str]:
        """The code a stage re-runs on: the closure its digest dep (data/code/stages/<script>.json) covers."""
        if "cmd" not in body or expected_code_dep(body) not in (body.get("deps") or []):
            return []
        return stage_closure(stage_script(body))

    for name, stage in stages.items():
        covered = [f for f in report_files if any(covers(d, f) for d in code(stage.get("do", stage)))]
        assert covered == (report_files if name == "report" else []), name

    def imported(path: Path) -> set[str]:
        """Every clipfinetune module a file imports (`from a.b import c` -> a.b.c when that is a module)."""
        found = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Import):
                found |= {a.name for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.module:
                found |= {f"{n.module}.{a.name}" if (root / f"{n.module}.{a.name}".replace(".", "/")).with_suffix(
                    ".py").exists() else n.module for a in n.names}
        return {m for m in found if m.startswith("clipfinetune.")}

    for f in (root / "clipfinetune/eval").rglob("*.py"):
        assert not any(m.startswith("clipfinetune.report") for m in imported(f)), f
    report_deps = code(stages["report"])
    for f in report_files:
        for m in imported(root / f) - {"clipfinetune.io"}:      # the atomic writers, undeclared by every stage
            assert any(covers(d, m.replace(".", "/") + ".py") for d in report_deps), (f, m)


def test_the_sample_worlds_limitations_stand_with_its_claims_and_agree_with_the_records():
    """On the sample world's set, reports/summary.md and the terminal summary carry one line on binding (the oracle
    at chance) and one on MulCLIP's local terms, each naming the research record its numbers come from. Without a
    mulclip run in the summary every number is a measured record: it must appear in the record the line names and
    in the README's "Known limitations". A real set carries no such line."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    limits = readme[readme.index("## Known limitations"):]
    limits = limits[:limits.index("\n## ", 1)]
    m, t = model()
    sample = report.summarize({"base": m, "clip": m}, "sample", {"base": t, "clip": t})
    md, text = report.render_markdown(sample), report.render_text(sample)
    lines = [line for line in md.splitlines() if line.startswith("- ")]
    binding = [line for line in lines if "binding" in line and "chance" in line and "inconclusive" in line]
    mulclip = [line for line in lines if "MulCLIP" in line and "L_Sub" in line]
    assert len(binding) == 1 and len(mulclip) == 1
    assert "## Known limitations of the sample world" in md
    assert "here" not in mulclip[0]                                # no mulclip run in this summary: no number of it
    for line in binding + mulclip:
        assert line[2:] in text                                    # the terminal view says the same
        (note,) = set(re.findall(r"docs/research/[\w-]+\.md", line))
        record = (root / note).read_text()
        numbers = re.findall(r"\d+\.\d+|\d+%", line)
        assert len(numbers) >= 3
        for number in numbers:
            assert number in record, f"{number} of the summary's line is not in {note}"
            assert number in limits, f"{number} of the summary's line is not in README's Known limitations"
    real = report.summarize({"base": m}, "real", {"base": t})
    assert "limitations" not in report.render_markdown(real).lower()
    assert "limitations" not in report.render_text(real).lower()


def test_the_mulclip_limitation_quotes_the_results_printed_beside_it():
    """With mulclip and mulclip_global_only in the summary, MulCLIP's line quotes their long R@1 (the mean of both
    directions, as the claims table prints it) and the claim's verdict; the record's numbers keep the record's name."""
    fewer = WORSE_ON_SOME                                              # 16 of 40 hits: 40.0 in both directions
    models = {"base": model(), "clip": model(), "mulclip": model(long_t2i=fewer, long_i2t=fewer),
              "mulclip_global_only": model()}                         # 20 of 40: 50.0
    sample = report.summarize({k: v[0] for k, v in models.items()}, "sample", {k: v[1] for k, v in models.items()})
    (line,) = [ln for ln in report.render_text(sample).splitlines() if ln.startswith("- MulCLIP")]
    verdict = sample["claims"]["mulclip"]["long_r1_beats_global_only"]["verdict"]
    assert verdict == "contradicted"
    assert "here mulclip scores 40.0 against 50.0 for mulclip_global_only" in line
    assert f"long_r1_beats_global_only: {verdict}" in line
    here = line.split("docs/research/mulclip-terms.md")[0].rsplit(". ", 1)[0]      # before the record's sentence
    assert "40.0" in here and "37.3" not in here and "53.0" not in here
    assert "37.3 against 53.0" in line.split("docs/research/mulclip-terms.md")[1]
