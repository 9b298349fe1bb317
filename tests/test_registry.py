"""The registry (clipfinetune/registry.py) is the one list of methods and runs: every other list of them is derived
from it or equal to it (params.yaml, dvc.yaml, the report's claims, custom's terms)."""
from __future__ import annotations

import inspect
from pathlib import Path

import yaml

from clipfinetune import registry
from clipfinetune.eval.report import claim_specs
from clipfinetune.methods import METHODS, get_method

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_every_registered_method_is_a_method_module_with_its_name():
    assert METHODS == (*registry.METHODS, registry.MIX)
    for name in METHODS:
        assert get_method(name).name == name


def test_params_evaluate_every_model_and_define_every_ablation():
    assert PARAMS["eval"]["models"] == list(registry.MODELS)
    assert set(PARAMS["ablations"]) == set(registry.ABLATIONS)


def test_dvc_trains_every_run_with_its_method():
    items = DVC["stages"]["train"]["foreach"]
    assert list(items) == list(registry.RUNS)
    assert {run: item["method"] for run, item in items.items()} == registry.RUNS
    for run, item in items.items():        # a run's own override group is its method's
        assert item["overrides"] == f"train.{registry.RUNS[run]}"


def test_report_depends_on_every_models_metrics_and_items_and_nothing_else_of_metrics():
    deps = [d for d in DVC["stages"]["report"]["deps"] if str(d).startswith("metrics/")]
    expected = [f"metrics/{m}.json" for m in registry.MODELS] + \
        [f"metrics/items/{m}.parquet" for m in registry.MODELS]
    assert sorted(deps) == sorted(expected)


def test_plots_show_every_run_and_the_loss_comparison_names_every_run():
    entries = [next(iter(p)) if isinstance(p, dict) else p for p in DVC["plots"]]
    per_run = [e for e in entries if str(e).startswith("dvclive/train/")]
    assert per_run == [f"dvclive/train/{run}/plots/metrics" for run in registry.RUNS]
    (comparison,) = [p for p in DVC["plots"] if isinstance(p, dict) and "train_loss_by_run" in p]
    assert list(comparison["train_loss_by_run"]["y"]) == \
        [f"dvclive/train/{run}/plots/metrics/loss.tsv" for run in registry.RUNS]


def test_claims_name_registered_methods_and_models_only():
    for method, claims in claim_specs().items():
        assert method in registry.METHODS, method
        for claim in claims.values():
            assert set(claim.models) <= set(registry.MODELS), claim


def test_each_methods_terms_are_switched_by_its_own_constructor_weights():
    """`custom` mixes "<method>.<term>" by the methods' own `terms`: every switching weight is a constructor
    argument of that method, and every method names at least its contrastive term."""
    for name in registry.METHODS:
        cls = get_method(name)
        kwargs = set(inspect.signature(cls.__init__).parameters)
        assert "contrastive" in cls.terms, name
        assert {w for w in cls.terms.values() if w} <= kwargs, name


def test_every_loss_reads_only_names_of_the_one_feature_vocabulary():
    """The features -> loss contract has one vocabulary (clipfinetune/losses/features.py): no loss reads a name
    outside it, and every name in it is read by some loss (no stale entry)."""
    import re

    from clipfinetune.losses.features import FEATURES

    read = set()
    for path in sorted((ROOT / "clipfinetune" / "losses").glob("*.py")):
        read |= set(re.findall(r'\bf(?:eatures)?(?:\["|\.get\(")([a-z_]+)"', path.read_text()))
    assert read - set(FEATURES) == set()
    assert set(FEATURES) - read == set()
