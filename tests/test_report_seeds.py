"""Seed aggregation (clipfinetune/report/seeds.py) on synthetic `dvc exp show --json` output: no training."""
import json
import math

import pytest

from clipfinetune.report import seeds


def summary(value, baseline, verdict, ret):
    return {"set": "sample", "headline": {"clip": {"ret_i2t_r1": ret, "box_top1": None}},
            "claims": {"harmoclip": {"box_cls_beats_clip": {
                "rule": "harmoclip > clip", "value": value, "baseline": baseline,
                "difference": None if value is None else value - baseline, "ci_low": -1.0, "ci_high": 1.0,
                "verdict": verdict}}}}


def exp_show(exps: dict, failed=()):
    """The shape `dvc exp show --json` prints (DVC 3): workspace, then the baseline commit with its experiments."""
    def rev(name, data, error=None):
        return {"rev": f"{abs(hash(name)):040x}"[:40], "name": name, "error": error,
                "data": {"params": {"params.yaml": {"data": {"train": {"seed": 0}}}},
                         "metrics": {"metrics/summary.json": {"data": data}} if data else {}}}
    return [{"rev": "workspace", "name": None, "data": rev("workspace", summary(1, 0, "holds", 1))["data"],
             "error": None, "experiments": None},
            {"rev": "a" * 40, "name": "main", "data": rev("main", summary(2, 0, "holds", 2))["data"], "error": None,
             "experiments": [{"revs": [rev(n, d)], "name": n, "executor": None} for n, d in exps.items()]
             + [{"revs": [rev(n, None, {"msg": "failed"})], "name": n} for n in failed]}]


def test_summaries_come_from_the_experiments_only_in_the_order_asked():
    rows = exp_show({"seed1": summary(61, 50, "holds", 40), "seed0": summary(60, 50, "holds", 41),
                     "other": summary(0, 0, "holds", 0)}, failed=["seed2"])
    got = seeds.summaries_from_exp_show(json.loads(json.dumps(rows)), ["seed0", "seed1", "seed2"])
    assert list(got) == ["seed0", "seed1"]               # workspace/baseline skipped, failed seed2 left out
    assert got["seed0"]["claims"]["harmoclip"]["box_cls_beats_clip"]["value"] == 60
    assert set(seeds.summaries_from_exp_show(rows)) == {"seed0", "seed1", "other"}


def test_mean_and_sample_sd_per_claim_and_headline_by_hand():
    agg = seeds.aggregate({"seed0": summary(60.0, 50.0, "holds", 40.0),
                           "seed1": summary(62.0, 50.0, "holds", 42.0),
                           "seed2": summary(64.0, 53.0, "inconclusive", 47.0)})
    c = agg["claims"]["harmoclip"]["box_cls_beats_clip"]
    # values 60, 62, 64: mean 62, sd sqrt((4 + 0 + 4) / 2) = 2; baselines 50, 50, 53: mean 51, sd sqrt(3)
    assert (c["value"]["mean"], c["value"]["sd"], c["value"]["n"]) == (62.0, 2.0, 3)
    assert c["baseline"]["mean"] == 51.0 and c["baseline"]["sd"] == pytest.approx(math.sqrt(3))
    # differences 10, 12, 11: mean 11, sd 1
    assert c["difference"]["mean"] == pytest.approx(11.0) and c["difference"]["sd"] == pytest.approx(1.0)
    assert c["verdicts"] == {"holds": 2, "inconclusive": 1} and c["rule"] == "harmoclip > clip"
    h = agg["headline"]["clip"]
    # 40, 42, 47: mean 43, sd sqrt((9 + 1 + 16) / 2) = sqrt(13); an all-missing cell stays missing
    assert h["ret_i2t_r1"]["mean"] == 43.0 and h["ret_i2t_r1"]["sd"] == pytest.approx(math.sqrt(13))
    assert h["box_top1"] == {"mean": None, "sd": None, "n": 0}
    md = seeds.render_markdown(agg)
    assert ("| harmoclip | box_cls_beats_clip | harmoclip > clip | 62.0 ± 2.0 | 51.0 ± 1.7 | +11.0 ± 1.0 | "
            "holds 2, inconclusive 1 |") in md
    assert "| clip | 43.0 ± 3.6 | – |" in md
    json.dumps(agg)


def test_one_experiment_has_no_sd_and_missing_values_are_not_counted():
    agg = seeds.aggregate({"seed0": summary(None, 50.0, "missing", 40.0), "seed1": summary(70.0, 50.0, "holds", 40.0)})
    c = agg["claims"]["harmoclip"]["box_cls_beats_clip"]
    assert c["value"] == {"mean": 70.0, "sd": None, "n": 1}
    assert c["baseline"]["sd"] == 0.0 and c["verdicts"] == {"missing": 1, "holds": 1}
    with pytest.raises(ValueError, match="no experiments"):
        seeds.aggregate({})
