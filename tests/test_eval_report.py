"""Report: claims logic (holds / fails / saturated / missing) and rendering from tiny metrics files."""
import json

import pytest

from clipfinetune.eval import plots, report


def metrics(ret=50.0, t2i=40.0, long_t2i=30.0, long_i2t=20.0, box=60.0, sc=70.0, zs=80.0):
    return {"retrieval": {"sample": {"i2t_r1": ret, "t2i_r1": t2i}},
            "long_retrieval": {"sample": {"t2i_r1": long_t2i, "i2t_r1": long_i2t}},
            "box_cls": {"sample": {"top1": box}},
            "compositionality": {"sugarcrepe": {"sample": {"mean": sc}}},
            "zeroshot": {"sample": {"acc1": zs}}, "skipped": {}}


def test_claims_hold_fail_saturate_and_go_missing():
    models = {"clip": metrics(), "harmoclip": metrics(box=65.0, ret=48.5),    # +5 box, -1.5 retrieval: holds
              "fsc_clip": metrics(sc=70.0, ret=47.0),                          # equal sugarcrepe; -3 retrieval
              "fsc_lhn_only": metrics(ret=49.0), "fsc_global_only": metrics(ret=45.0),
              "goal": metrics(long_t2i=99.5), "goal_global_only": metrics(long_t2i=99.0),
              "degla": metrics(sc=69.0, zs=81.0), "degla_no_distill": metrics(zs=80.0),
              "mulclip": metrics(long_t2i=35.0, long_i2t=20.0), "mulclip_global_only": None}
    c = report.claims(models)
    assert c["harmoclip"]["box_cls_beats_clip"]["holds"] is True
    assert c["harmoclip"]["box_cls_beats_clip"]["value"] == 65.0 and c["harmoclip"]["box_cls_beats_clip"]["baseline"] == 60.0
    assert c["harmoclip"]["retrieval_kept"]["holds"] is True                    # 48.5 >= 50 - 2
    assert c["fsc_clip"]["sugarcrepe_beats_clip"]["holds"] == "saturated"        # equal values
    assert c["fsc_clip"]["retrieval_kept"]["holds"] is False                     # 47 < 48
    lhn = c["fsc_clip"]["lhn_keeps_retrieval"]
    assert (lhn["value"], lhn["baseline"], lhn["holds"]) == (1.0, 5.0, True)
    assert c["goal"]["long_t2i_beats_global_only"]["holds"] == "saturated"       # both >= 99
    assert c["goal"]["long_t2i_beats_clip"]["holds"] is True
    assert c["degla"]["sugarcrepe_beats_clip"]["holds"] is False
    assert c["degla"]["zeroshot_kept_vs_no_distill"]["holds"] is True
    assert c["mulclip"]["long_r1_beats_clip"]["value"] == pytest.approx(27.5)    # mean(35, 20)
    assert c["mulclip"]["long_r1_beats_clip"]["baseline"] == pytest.approx(25.0)
    assert c["mulclip"]["long_r1_beats_clip"]["holds"] is True
    assert c["mulclip"]["long_r1_beats_global_only"]["holds"] == "missing"       # no metrics file
    assert c["mulclip"]["retrieval_kept"]["holds"] == "saturated"              # equal to clip


def test_missing_metric_inside_a_file_is_missing_not_a_crash():
    m = metrics()
    del m["box_cls"]
    c = report.claims({"clip": metrics(), "harmoclip": m})
    assert c["harmoclip"]["box_cls_beats_clip"]["holds"] == "missing"
    assert c["goal"]["long_t2i_beats_clip"]["holds"] == "missing"


def test_zeroshot_equal_is_saturated_not_holding():
    c = report.claims({"degla": metrics(zs=80.0), "degla_no_distill": metrics(zs=80.0)})
    assert c["degla"]["zeroshot_kept_vs_no_distill"]["holds"] == "saturated"


def test_report_renders_from_tiny_metric_files_with_only_base_and_clip(tmp_path):
    (tmp_path / "base.json").write_text(json.dumps(metrics(ret=40.0)))
    (tmp_path / "clip.json").write_text(json.dumps(metrics(ret=50.0)))
    models = report.load_metrics({m: tmp_path / f"{m}.json" for m in ("base", "clip", "harmoclip")})
    s = report.summarize(models)
    assert s["missing_models"] == ["harmoclip"]
    assert s["headline"]["clip"]["ret_i2t_r1"] == 50.0 and s["headline"]["clip"]["gl_i2t_map10"] is None
    assert s["delta_vs_base"]["clip"]["ret_i2t_r1"] == pytest.approx(10.0)
    assert s["delta_vs_clip"]["base"]["ret_i2t_r1"] == pytest.approx(-10.0)
    assert s["claims"]["harmoclip"]["box_cls_beats_clip"]["holds"] == "missing"
    written = plots.write_plots(s, tmp_path)
    assert len(written) == 3 and all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in written)
    assert [m for m, _, _ in plots.plot_points(s, ("ret_i2t_r1",), ("box_top1",))] == ["base", "clip"]
    md = report.render_markdown(s, written)
    assert "| clip | 50.0 (+10.0 / –)" in md
    assert "| harmoclip | box_cls_beats_clip |" in md and "missing" in md
    json.dumps(s)                                  # serialisable as the DVC metrics file
