"""The paired bootstrap (clipfinetune/report/bootstrap.py): a hand-computed interval, pairing, determinism."""
import numpy as np
import pytest

from clipfinetune.report.bootstrap import paired_bootstrap, resample_indices


def _mean_of(values):
    values = np.asarray(values, dtype=np.float64)
    return lambda idx: values[idx["s"]].mean(axis=-1)


def test_percentile_interval_of_a_mean_matches_the_binomial_by_hand():
    # items 0, 0, 0, 4: a resample's mean is k, k ~ Binomial(4, 1/4) = how often the 4 is drawn.
    # P(k=0) = 0.316 > 2.5% -> lower bound 0. P(k<=2) = 0.949 < 97.5% < P(k<=3) = 0.996 -> upper bound 3.
    ci = paired_bootstrap({"s": 4}, _mean_of([0, 0, 0, 4]), n_resamples=4000, seed=3)
    assert ci["estimate"] == 1.0
    assert (ci["low"], ci["high"]) == (0.0, 3.0)
    assert ci["n_resamples"] == 4000 and ci["level"] == 0.95


def test_two_items_give_the_full_range_and_the_middle_half_the_time():
    # items 0, 1: resample means 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4 -> 95% CI [0, 1]
    stats = []
    ci = paired_bootstrap({"s": 2}, lambda idx: stats.append(idx["s"].mean(-1)) or idx["s"].mean(-1),
                          n_resamples=2000, seed=0)
    assert (ci["low"], ci["high"]) == (0.0, 1.0)
    assert np.mean(stats[-1] == 0.5) == pytest.approx(0.5, abs=0.05)


def test_the_two_models_are_resampled_on_the_same_items():
    # baseline: arbitrary per-item scores; method = baseline + 1 on every item. Paired, every resample's
    # difference is exactly 1; resampled independently it would spread over several points.
    rng = np.random.default_rng(0)
    base = rng.uniform(0, 100, 50)
    method = base + 1.0
    ci = paired_bootstrap({"s": 50}, lambda idx: method[idx["s"]].mean(-1) - base[idx["s"]].mean(-1))
    assert ci["estimate"] == pytest.approx(1.0)
    assert ci["low"] == pytest.approx(1.0) and ci["high"] == pytest.approx(1.0)


def test_better_on_every_item_is_positive_worse_negative_identical_zero():
    base = np.tile([0.0, 1.0], 20)                   # 50% correct
    better, worse = np.ones(40), np.zeros(40)

    def diff(a, b):
        return lambda idx: 100 * (a[idx["s"]].mean(-1) - b[idx["s"]].mean(-1))
    up = paired_bootstrap({"s": 40}, diff(better, base))
    down = paired_bootstrap({"s": 40}, diff(worse, base))
    same = paired_bootstrap({"s": 40}, diff(base, base))
    assert up["estimate"] == 50.0 and up["low"] > 0
    assert down["estimate"] == -50.0 and down["high"] < 0
    assert (same["estimate"], same["low"], same["high"]) == (0.0, 0.0, 0.0)


def test_resamples_are_deterministic_per_stratum_and_differ_between_strata():
    a = resample_indices(30, 100, 0, "retrieval.sample/i2t")
    assert a.shape == (100, 30) and a.min() >= 0 and a.max() < 30
    assert np.array_equal(a, resample_indices(30, 100, 0, "retrieval.sample/i2t"))
    assert not np.array_equal(a, resample_indices(30, 100, 0, "retrieval.sample/t2i"))
    assert not np.array_equal(a, resample_indices(30, 100, 1, "retrieval.sample/i2t"))
    f = _mean_of(np.arange(30))
    assert paired_bootstrap({"s": 30}, f, seed=5) == paired_bootstrap({"s": 30}, f, seed=5)


def test_each_stratum_is_resampled_on_its_own():
    # mean of two files' accuracies, sizes 3 and 5: a resample draws 3 indices < 3 and 5 indices < 5
    seen = {}

    def stat(idx):
        seen.update(idx)
        return (idx["a"].mean(-1) + idx["b"].mean(-1)) / 2
    paired_bootstrap({"a": 3, "b": 5}, stat, n_resamples=200)
    assert seen["a"].shape == (200, 3) and seen["a"].max() == 2
    assert seen["b"].shape == (200, 5) and seen["b"].max() == 4


def test_a_statistic_of_the_wrong_shape_or_an_empty_stratum_is_an_error():
    with pytest.raises(ValueError, match="shape"):
        paired_bootstrap({"s": 3}, lambda idx: idx["s"].mean(), n_resamples=10)
    with pytest.raises(ValueError, match="no items"):
        resample_indices(0, 10, 0, "empty")
