"""The registry (clipfinetune/registry.py) is the one list of methods and runs: every other list of them is derived
from it or equal to it (params.yaml `runs` and `eval.models`, the report's claims, custom's terms); dvc.yaml lists
none of them."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import yaml

from clipfinetune import registry
from clipfinetune.methods import METHODS, get_method
from clipfinetune.report.summary import claim_specs

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


def test_params_runs_train_every_registered_run_with_its_method():
    """dvc.yaml's `train` is `foreach: ${runs}`: the params-side run list IS the stage list."""
    assert DVC["stages"]["train"]["foreach"] == "${runs}"
    assert list(PARAMS["runs"]) == list(registry.RUNS)
    assert {run: item["method"] for run, item in PARAMS["runs"].items()} == registry.RUNS
    # every run item has the same slots (DVC's `${item.<slot>}` fails on a missing one)
    assert {tuple(sorted(item)) for item in PARAMS["runs"].values()} == {("method", "p1", "p2", "p3", "p4", "p5", "p6")}


def test_dvc_yaml_names_no_run_or_model():
    """Nothing in dvc.yaml lists runs or models: the train/eval stages, the report's deps and the curves come from
    params (`runs`, `eval.models`) through foreach, a folder dep and per-run plot outputs."""
    text = (ROOT / "dvc.yaml").read_text()
    for name in registry.MODELS:         # models/base is pretrain's output (and lism's model), not a listed model
        assert not re.search(rf"(metrics|metrics/items|dvclive/train)/{name}\b", text), name
    for name in registry.RUNS:
        assert not re.search(rf"models/{name}\b", text), name
    assert DVC["stages"]["eval"]["foreach"] == "${eval.models}"
    assert "metrics/items" in DVC["stages"]["report"]["deps"]
    train = DVC["stages"]["train"]["do"]
    assert [next(iter(p)) for p in train["plots"]] == ["dvclive/train/${key}/plots/metrics"]


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
    from clipfinetune.losses.features import FEATURES

    read = set()
    for path in sorted((ROOT / "clipfinetune" / "losses").glob("*.py")):
        read |= set(re.findall(r'\bf(?:eatures)?(?:\["|\.get\(")([a-z_]+)"', path.read_text()))
    assert read - set(FEATURES) == set()
    assert set(FEATURES) - read == set()
