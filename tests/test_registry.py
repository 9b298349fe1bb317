"""The registry (clipfinetune/registry.py) is the one list of methods, params.yaml `runs` the one list of runs: the
train/eval stages and the report's models are derived from `runs`; dvc.yaml lists none of them."""
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


def test_every_run_names_a_registered_method():
    assert {item["method"] for item in PARAMS["runs"].values()} <= set(METHODS)
    assert "models" not in PARAMS["eval"]            # no second list: the evaluated models are base + the runs


def test_dvc_yaml_names_no_run_or_model():
    """Nothing in dvc.yaml lists runs or models: train@, eval@ come from params `runs` through foreach, eval_base
    is the same stage body for `base`, the report's deps a folder and the curves per-run plot outputs."""
    text = (ROOT / "dvc.yaml").read_text()
    for name in PARAMS["runs"]:
        assert not re.search(rf"(models|metrics|metrics/items|dvclive/train)/{name}\b", text), name
    assert DVC["stages"]["train"]["foreach"] == DVC["stages"]["eval"]["foreach"] == "${runs}"
    base = {k: v for k, v in DVC["stages"]["eval_base"].items() if k != "vars"}
    assert base == DVC["stages"]["eval"]["do"] and DVC["stages"]["eval_base"]["vars"] == [{"key": "base"}]
    assert "metrics/items" in DVC["stages"]["report"]["deps"]
    train = DVC["stages"]["train"]["do"]
    assert [next(iter(p)) for p in train["plots"]] == ["dvclive/train/${key}/plots/metrics"]


def test_claims_name_registered_methods_and_models_only():
    for method, claims in claim_specs().items():
        assert method in registry.METHODS, method
        for claim in claims.values():
            assert set(claim.models) <= {"base", *PARAMS["runs"]}, claim


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
    pretraining = ROOT / "clipfinetune" / "sample" / "pretrain" / "loss.py"      # the sample world's base CLIP
    for path in [*sorted((ROOT / "clipfinetune" / "losses").glob("*.py")), pretraining]:
        read |= set(re.findall(r'\bf(?:eatures)?(?:\["|\.get\(")([a-z_]+)"', path.read_text()))
    assert read - set(FEATURES) == set()
    assert set(FEATURES) - read == set()


def test_methods_are_discovered_from_their_modules(tmp_path):
    """A new method is its files: a module in methods/ is registered (the baseline first, then by name), the
    protocol, the mix and `_` helpers are not; registry.py itself is not edited."""
    for name in ("base", "custom", "_helpers", "zeta", "clip", "alpha", "__init__"):
        (tmp_path / f"{name}.py").write_text("")
    assert registry.discover(tmp_path) == ("clip", "alpha", "zeta")
    assert registry.METHODS == registry.discover()
