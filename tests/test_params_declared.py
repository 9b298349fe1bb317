"""dvc.yaml's declared params against params.yaml and the code that reads them.

A stage sees only the keys dvc.yaml declares for it (stages/_common.py), so a key that is declared but absent,
declared too broadly (a whole shared group) or declared by a run whose method ignores it would re-run stages for
nothing or hide a value. The stages are expanded by DVC itself (foreach/`${...}`) from a copy of dvc.yaml and
params.yaml in a temporary DVC repo; the method -> loss-key map comes from the methods' constructor signatures.

Dict-valued declarations allowed (each is ONE setting that one stage family reads whole, never a shared group):
  - `train.<method>`      the run's own override group (its keys are checked against TrainConfig by the stage);
  - `ablations.<run>`     the ablation run's own loss weights (read whole, flattened to the method's kwargs);
  - `custom.terms`        the custom run's term -> weight mix (the weights ARE the setting);
  - `sources.<name>`      one source's definition (its reader and paths), read whole by the stages that list it;
  - `sources` (stage `shards` only): whichever sources `shards.sources` names, so training on a new source is a
                          params.yaml edit; a change to a source shards does not list re-runs shards alone, whose
                          byte-identical output leaves every train@ run untouched;
  - `eval.benchmarks`     the benchmark configuration: stage `benchmarks` (which lists its files) and every
                          eval@<model> read all of it, and a change to any
                          benchmark path must re-run every eval anyway, so key-by-key declarations would re-run
                          nothing less and would make adding a benchmark set a dvc.yaml edit.
"""
from __future__ import annotations

import importlib.util
import inspect
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from clipfinetune.methods import get_method

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
SHARED_GROUPS = set(PARAMS) | {"train", "loss", "ablations", "custom", "eval", "model"}
DICT_DECLARATIONS_OK = {"eval.benchmarks", "custom.terms"} | {f"sources.{name}" for name in PARAMS["sources"]}
WHOLE_GROUP_OK = {("shards", "sources")}


def _lookup(key: str):
    node = PARAMS
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


@pytest.fixture(scope="module")
def declared(tmp_path_factory) -> dict[str, list[str]]:
    """stage name -> declared params.yaml keys, as DVC expands dvc.yaml."""
    from dvc.repo import Repo

    tmp = tmp_path_factory.mktemp("declared")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp / name)
    Repo.init(str(tmp), no_scm=True)
    out = {}
    with Repo(str(tmp)) as repo:
        for stage in repo.index.stages:
            keys = [k for dep in stage.params for k in dep.params]
            assert all(Path(dep.def_path).name == "params.yaml" for dep in stage.params), stage.name
            out[stage.name] = sorted(set(keys))
    return out


def _train_runs():
    """params.yaml `runs` (dvc.yaml: `train: foreach: ${runs}`)."""
    return PARAMS["runs"]


def test_dvc_expands_every_stage(declared):
    assert {s for s in declared if s.startswith("train@")} == {f"train@{r}" for r in _train_runs()}
    assert {s for s in declared if s.startswith("eval@")} == {f"eval@{m}" for m in PARAMS["eval"]["models"]}
    assert {s for s in declared if "@" not in s} >= {"benchmarks", "report"}


def test_every_declared_key_exists_in_params_yaml(declared):
    missing = {(stage, key) for stage, keys in declared.items() for key in keys if not _has(key)}
    assert not missing


def _has(key):
    try:
        _lookup(key)
        return True
    except KeyError:
        return False


def test_no_stage_declares_a_whole_shared_group(declared):
    runs = _train_runs()
    allowed = DICT_DECLARATIONS_OK | {f"train.{item['method']}" for item in runs.values()} \
        | {f"ablations.{run}" for run in PARAMS["ablations"]}
    for stage, keys in declared.items():
        whole = {k for k in set(keys) & SHARED_GROUPS if (stage, k) not in WHOLE_GROUP_OK}
        assert not whole, (stage, whole)
        broad = {k for k in keys if isinstance(_lookup(k), dict) and _lookup(k) and (stage, k) not in WHOLE_GROUP_OK}
        assert broad <= allowed, (stage, broad - allowed)


def test_a_train_run_declares_only_its_own_override_and_ablation_groups(declared):
    for run, item in _train_runs().items():
        keys = declared[f"train@{run}"]
        assert [k for k in keys if k.startswith("train.") and isinstance(_lookup(k), dict)] == [f"train.{item['method']}"]
        assert [k for k in keys if k.startswith("ablations.")] == ([f"ablations.{run}"] if run in PARAMS["ablations"] else [])


def _kwargs_in(group: str, method: str) -> set[str]:
    names = set(inspect.signature(get_method(method).__init__).parameters) - {"self"}
    return {f"{group}.{n}" for n in names if n in (PARAMS.get(group) or {})}


def test_loss_keys_are_declared_exactly_by_the_runs_whose_method_reads_them(declared):
    for stage, keys in declared.items():
        loss = {k for k in keys if k.startswith("loss.")}
        if not stage.startswith("train@"):
            assert not loss, stage
            continue
        run = stage.split("@", 1)[1]
        method = _train_runs()[run]["method"]
        expected = set() if run in PARAMS["ablations"] else _kwargs_in("loss", method)
        assert loss == expected, (stage, loss ^ expected)
        # method kwargs that live in other groups (model.unlocked_vision_layers, sentences.max_sentences)
        for group in ("model", "sentences", "custom"):
            assert _kwargs_in(group, method) <= set(keys), (stage, group)


def test_ablation_weights_are_kwargs_of_their_method():
    for run, weights in PARAMS["ablations"].items():
        method = _train_runs()[run]["method"]
        names = set(inspect.signature(get_method(method).__init__).parameters)
        assert set(weights) <= names, (run, set(weights) - names)
        # an ablation names every loss weight of its method, so the run never falls back to loss.* silently
        assert {f"loss.{w}" for w in weights} == _kwargs_in("loss", method), run


def _stage_train():
    sys.path.insert(0, str(ROOT / "stages"))
    spec = importlib.util.spec_from_file_location("stage_train_declared", ROOT / "stages" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, sys.modules["_common"].StageParams


def _nest(keys: list[str]) -> dict:
    out: dict = {}
    for key in keys:
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = _lookup(key)
    return out


def test_each_train_run_reads_every_key_it_declares_and_builds_its_method(declared):
    """The train stage's own param-reading path with a recording StageParams (what check_all_read enforces)."""
    stage, StageParams = _stage_train()
    for run, item in _train_runs().items():
        params = StageParams(f"train@{run}", _nest(declared[f"train@{run}"]))
        method_cls = get_method(item["method"])
        _settings, config = stage.run_settings(params, run, item["method"], method_cls)
        params["model.precision"]
        params["compute.device"]                    # init_distributed's setting
        sys.modules["_common"].stage_ranks(params)  # start(): ranks to launch (1 here: CPU)
        params.check_all_read()
        method_cls(**config)                        # every flattened key is a constructor argument


def test_non_train_stages_declare_no_loss_or_train_keys(declared):
    for stage, keys in declared.items():
        if stage.startswith("train@"):
            continue
        assert not [k for k in keys if k.split(".")[0] in ("loss", "ablations", "custom", "train")], stage
