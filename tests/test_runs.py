"""Run resolution (clipfinetune/runs.py): a run takes its method's weights from params `loss`, states only what it
changes, and gets the shared training settings merged with its method's group; anything unknown fails naming it."""
from __future__ import annotations

import inspect
import shutil
from pathlib import Path

import pytest
import yaml

from clipfinetune.methods import get_method
from clipfinetune.runs import resolve_runs

ROOT = Path(__file__).resolve().parents[1]
# docs/design.md §3: the `loss.*` keys by paper, the papers' symbols (the spec the params file follows)
DESIGN_LOSS_KEYS = {
    "harmoclip": {"lambda_lrc", "lambda_gr"},
    "fsc_clip": {"lambda_g", "lambda_l", "focal_gamma", "label_smoothing"},
    "goal": {"lambda_global", "lambda_local", "lambda_tsl", "tsl_target"},
    "degla": {"lambda_igc", "lambda_tgc", "lambda_distill", "ema_alpha", "tgc_logit_scale"},
    "mulclip": {"lambda_short", "lambda_word", "lambda_sub", "token_ratio"},
}
SHARED = {"epochs": 2, "batch_size": 64, "lr": 2e-4, "warmup": 10, "seed": 0}


def params(**changes) -> dict:
    """A small params mapping: FSC-CLIP and HarmoCLIP weights, four runs, the mix."""
    base = {
        "loss": {"lambda_g": 0.5, "lambda_l": 0.5, "focal_gamma": 2.0, "label_smoothing": 0.02,
                 "lambda_lrc": 1.0, "lambda_gr": 0.7},
        "runs": {"clip": {"method": "clip"}, "fsc_clip": {"method": "fsc_clip"},
                 "fsc_lhn_only": {"method": "fsc_clip", "lambda_g": 0.0},
                 "harmo_last4": {"method": "harmoclip", "unlocked_vision_layers": 4},
                 "custom": {"method": "custom", "terms": {"fsc_clip.local_hn": 0.5}}},
        "train": {**SHARED, "keep_checkpoint": False, "clip": {}, "fsc_clip": {"lr": 5e-6},
                  "mulclip": {"new_module_lr": 2e-3}},
        "model": {"precision": "auto"},
    }
    for group, value in changes.items():
        base[group] = value(base[group]) if callable(value) else value
    return base


def changed_runs(before: dict, after: dict) -> set[str]:
    return {run for run in before if before[run] != after[run]}


def test_a_run_takes_its_methods_weights_from_loss_and_states_only_what_it_changes():
    runs = resolve_runs(params())
    assert runs["fsc_clip"]["config"] == {"lambda_g": 0.5, "lambda_l": 0.5, "focal_gamma": 2.0,
                                          "label_smoothing": 0.02}
    assert runs["fsc_lhn_only"]["config"] == {"lambda_g": 0.0, "lambda_l": 0.5, "focal_gamma": 2.0,
                                              "label_smoothing": 0.02}
    assert runs["harmo_last4"]["config"] == {"lambda_lrc": 1.0, "lambda_gr": 0.7, "unlocked_vision_layers": 4}
    assert runs["clip"]["config"] == {} and runs["custom"]["config"] == {"terms": {"fsc_clip.local_hn": 0.5}}
    assert {r["method"] for r in runs.values()} == {"clip", "fsc_clip", "harmoclip", "custom"}


def test_a_loss_weight_reaches_every_run_of_its_method_that_does_not_set_it_and_no_other():
    before = resolve_runs(params())
    after = resolve_runs(params(loss=lambda loss: {**loss, "lambda_l": 0.2}))
    assert changed_runs(before, after) == {"fsc_clip", "fsc_lhn_only"}      # the mix's weights are its own terms
    assert after["fsc_lhn_only"]["config"]["lambda_l"] == 0.2
    zeroed = resolve_runs(params(loss=lambda loss: {**loss, "lambda_g": 0.9}))
    assert changed_runs(before, zeroed) == {"fsc_clip"}                       # the ablation keeps its own 0.0


def test_the_older_spelling_runs_run_weight_overrides_loss_for_that_run_alone():
    before = resolve_runs(params())
    after = resolve_runs(params(runs=lambda runs: {**runs, "fsc_clip": {"method": "fsc_clip", "lambda_l": 0.2}}))
    assert changed_runs(before, after) == {"fsc_clip"}
    assert after["fsc_clip"]["config"]["lambda_l"] == 0.2 and after["fsc_lhn_only"]["config"]["lambda_l"] == 0.5


def test_training_settings_are_the_shared_ones_merged_with_the_methods_group():
    runs = resolve_runs(params(runs=lambda runs: {**runs, "mulclip": {"method": "mulclip"}}))
    assert runs["clip"]["train"] == SHARED                                   # keep_checkpoint is the stage's own
    assert runs["fsc_lhn_only"]["train"] == {**SHARED, "lr": 5e-6}
    assert runs["harmo_last4"]["train"] == SHARED                            # no group: the shared settings
    assert runs["mulclip"]["config"]["new_module_lr"] == 2e-3 and "new_module_lr" not in runs["mulclip"]["train"]
    assert {r["precision"] for r in runs.values()} == {"auto"}


@pytest.mark.parametrize("change,named", [
    ({"runs": lambda r: {**r, "fsc_clip": {"method": "fsc_clip", "lambda_ll": 0.2}}}, r"runs\.fsc_clip\.lambda_ll"),
    ({"runs": lambda r: {**r, "fsc_clip": {"method": "fsc_clip", "lambda_lrc": 0.2}}},
     r"runs\.fsc_clip\.lambda_lrc.*harmoclip's loss weight"),
    ({"runs": lambda r: {**r, "fsc_clip": {"method": "fsc_clip", "lr": 1e-5}}}, r"runs\.fsc_clip\.lr.*train\.fsc_clip"),
    ({"runs": lambda r: {**r, "x": {"method": "fsc-clip"}}}, r"runs\.x\.method.*'fsc-clip'"),
    ({"runs": lambda r: {**r, "x": {"lambda_l": 0.2}}}, r"runs\.x: .*method"),
    ({"loss": lambda loss: {**loss, "lambda_x": 1.0}}, r"loss\.lambda_x: no method takes it"),
    ({"train": lambda t: {**t, "fsc-clip": {"lr": 1.0}}}, r"\['fsc-clip'\] are no method's"),
    ({"train": lambda t: {**t, "clip": {"lr_": 1.0}}}, r"train\.clip.*lr_"),
    ({"runs": lambda r: {**r, "m": {"method": "mulclip", "new_module_lr": 1.0}}}, r"runs\.m: \['new_module_lr'\]"),
    ({"model": {"precision": "bf32"}}, r"model\.precision: 'bf32'"),
])
def test_an_unknown_or_misplaced_key_fails_naming_it(change, named):
    with pytest.raises(ValueError, match=named):
        resolve_runs(params(**change))


def _committed_params() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_params_yaml_loss_group_is_designs_keys_each_one_methods_constructor_argument():
    loss = _committed_params()["loss"]
    assert set(loss) == set().union(*DESIGN_LOSS_KEYS.values())
    for method, keys in DESIGN_LOSS_KEYS.items():
        assert keys <= set(inspect.signature(get_method(method).__init__).parameters), method


def test_every_committed_run_resolves_and_builds_its_method():
    runs = resolve_runs(_committed_params())
    for run in runs.values():
        get_method(run["method"])(**run["config"])                # every key is a constructor argument
    loss = _committed_params()["loss"]
    assert runs["fsc_lhn_only"]["config"] == {"lambda_g": 0.0, "lambda_l": loss["lambda_l"],
                                              "focal_gamma": loss["focal_gamma"],
                                              "label_smoothing": loss["label_smoothing"]}


@pytest.mark.parametrize("recipe", ["harmoclip", "fsc_clip", "goal", "degla", "mulclip"])
def test_every_recipes_runs_resolve_over_the_real_base_and_build_their_methods(recipe):
    """A recipe's weights (its `loss` keys) reach each of its runs; a run states only what it changes."""
    from clipfinetune.project import profile

    params = profile.merged([ROOT / "params.yaml", ROOT / "params.real.yaml", ROOT / "recipes" / f"{recipe}.yaml"])
    own = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    runs = resolve_runs(params)
    assert {run["method"] for run in runs.values()} == {recipe}
    for name, run in runs.items():
        get_method(run["method"])(**run["config"])
        stated = {k: v for k, v in own["runs"][name].items() if k != "method"}
        expected = {**own["loss"], **stated}              # the recipe's weights, what the run changes on top
        assert {k: run["config"].get(k) for k in expected} == expected, name


def test_dvc_set_param_of_a_loss_key_or_of_one_runs_weight(tmp_path):
    """`dvc exp run -S` rewrites params.yaml with these overrides (DVC's own function): `loss.lambda_l` moves
    FSC-CLIP's runs that do not set lambda_l; `+runs.fsc_clip.lambda_l` (hydra's `+` adds a key the run does not
    state yet) moves fsc_clip alone."""
    from dvc.utils.hydra import apply_overrides

    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    before = resolve_runs(yaml.safe_load(path.read_text()))
    apply_overrides(str(path), ["loss.lambda_l=0.2"])
    swept = resolve_runs(yaml.safe_load(path.read_text()))
    assert changed_runs(before, swept) == {"fsc_clip", "fsc_lhn_only"}
    shutil.copy(ROOT / "params.yaml", path)
    apply_overrides(str(path), ["+runs.fsc_clip.lambda_l=0.2"])
    one = resolve_runs(yaml.safe_load(path.read_text()))
    assert changed_runs(before, one) == {"fsc_clip"} and one["fsc_clip"]["config"]["lambda_l"] == 0.2
