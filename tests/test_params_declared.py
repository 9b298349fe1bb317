"""dvc.yaml's declared params against params.yaml and the code that reads them.

A stage sees only the keys dvc.yaml declares for it (stages/_common.py), so a key that is declared but absent,
declared too broadly (a whole shared group) or declared by a run whose method ignores it would re-run stages for
nothing or hide a value. The stages are expanded by DVC itself (foreach/`${...}`) from a copy of dvc.yaml and
params.yaml in a temporary DVC repo; the method -> loss-key map comes from the methods' constructor signatures.

Dict-valued declarations allowed (each is ONE setting that one stage family reads whole, never a shared group):
  - `loss`, `runs`, `train` (stage `run_settings` only): it resolves every run's effective settings from all three
                          (clipfinetune/runs.py) into data/runs/<run>.json, which train@<run> depends on instead of
                          params (a foreach cannot declare one run's `loss.*` keys): a change re-trains exactly the
                          runs whose file changes;
  - `runs` (stage `report` only): the models it reports (base and every run); a run's change re-runs its eval and
                          so the report anyway;
  - `sources.<name>`      one source's definition (its reader and paths), read whole by the stages that list it;
  - `sources` (stage `shards` only): whichever sources `shards.sources` names, so training on a new source is a
                          params.yaml edit; a change to a source shards does not list re-runs shards alone, whose
                          byte-identical output leaves every train@ run untouched;
  - `eval.evalsets`       the benchmark configuration: stage `evalsets` (which lists its files) and every
                          eval@<model> read all of it, and a change to any
                          benchmark path must re-run every eval anyway, so key-by-key declarations would re-run
                          nothing less and would make adding a benchmark set a dvc.yaml edit.
"""
from __future__ import annotations

import inspect
from pathlib import Path

from stages import _common
from stages import run_settings as run_settings_stage

import pytest
import yaml
from fixtures.project import dvc_expanded_stages

from clipfinetune.keys import lookup
from clipfinetune.methods import get_method

ROOT = Path(__file__).resolve().parents[1]
PARAMS = yaml.safe_load((ROOT / "params.yaml").read_text())
SHARED_GROUPS = set(PARAMS) | {"train", "eval", "model"}
DICT_DECLARATIONS_OK = {"eval.evalsets"} | {f"sources.{name}" for name in PARAMS["sources"]}
WHOLE_GROUP_OK = {("shards", "sources"), ("report", "runs")} \
    | {("run_settings", group) for group in ("loss", "runs", "train")}


def _lookup(key: str):
    return lookup(PARAMS, key)


@pytest.fixture(scope="module")
def expanded(tmp_path_factory) -> dict[str, dict]:
    """stage name -> its declared params.yaml keys, deps and outs, as DVC itself expands dvc.yaml."""
    out = dvc_expanded_stages(tmp_path_factory.mktemp("declared"))
    for name, stage in out.items():
        assert stage["params_files"] <= {"params.yaml"}, name
    return out


@pytest.fixture(scope="module")
def declared(expanded) -> dict[str, list[str]]:
    """stage name -> declared params.yaml keys, as DVC expands dvc.yaml."""
    return {name: stage["params"] for name, stage in expanded.items()}


def _paths(entries) -> list[str]:
    return [e if isinstance(e, str) else next(iter(e)) for e in entries or []]


def test_a_stage_reads_its_definition_as_dvc_expands_it(expanded):
    """stages/_common.py reads dvc.yaml and params.yaml as files (no DVC internals, no dvc.lock): every stage's cmd,
    deps, outs and declared keys equal DVC's own expansion (foreach over a list and a mapping, `${item...}`,
    `${key}`, a stage's `vars` through a YAML merge key, params.yaml values in paths)."""
    for name, dvc_stage in expanded.items():
        mine = _common.stage_definition(name, ROOT)
        assert mine["cmd"] == dvc_stage["cmd"], name
        assert _paths(mine.get("deps")) == dvc_stage["deps"], name
        assert sorted(_paths(mine.get("outs")) + _paths(mine.get("metrics")) + _paths(mine.get("plots"))) == \
            dvc_stage["outs"], name
        assert sorted(key for _, key in _common.declared_keys(mine, ROOT)) == dvc_stage["params"], name


@pytest.mark.parametrize("stage", ["train@clip", "eval_base", "shards", "word_regions@coco"])
def test_a_stage_sees_the_values_dvc_api_params_show_gives(stage):
    import dvc.api

    assert _common.stage_params(stage)._values == dvc.api.params_show(stages=[stage], repo=str(ROOT))


def test_an_unknown_stage_or_entry_or_missing_key_fails_naming_it(tmp_path):
    (tmp_path / "params.yaml").write_text("runs: {a: {method: clip}}\nlr: 1.0\n")
    (tmp_path / "dvc.yaml").write_text(
        "stages:\n  train:\n    foreach: ${runs}\n    do:\n      cmd: python t.py --method ${item.method}\n"
        "      params: [lr, absent.key]\n  bad:\n    cmd: python b.py ${nowhere}\n")
    assert _common.stage_definition("train@a", tmp_path)["cmd"] == "python t.py --method clip"
    with pytest.raises(SystemExit, match="no stage 'eval'"):
        _common.stage_definition("eval@a", tmp_path)
    with pytest.raises(SystemExit, match="no entry 'b'"):
        _common.stage_definition("train@b", tmp_path)
    with pytest.raises(SystemExit, match=r"\$\{nowhere\} is not defined"):
        _common.stage_definition("bad", tmp_path)
    with pytest.raises(SystemExit, match="'absent.key', which params.yaml lacks"):
        _common.declared_params(_common.stage_definition("train@a", tmp_path), tmp_path)


def _train_runs():
    """params.yaml `runs` (dvc.yaml: `train: foreach: ${runs}`)."""
    return PARAMS["runs"]


def test_dvc_expands_every_stage(declared):
    assert {s for s in declared if s.startswith("train@")} == {f"train@{r}" for r in _train_runs()}
    assert {s for s in declared if s.startswith("eval@")} == {f"eval@{r}" for r in _train_runs()}
    assert {s for s in declared if "@" not in s} >= {"evalsets", "report", "eval_base"}


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
    allowed = DICT_DECLARATIONS_OK
    for stage, keys in declared.items():
        whole = {k for k in set(keys) & SHARED_GROUPS if (stage, k) not in WHOLE_GROUP_OK}
        assert not whole, (stage, whole)
        broad = {k for k in keys if isinstance(_lookup(k), dict) and _lookup(k) and (stage, k) not in WHOLE_GROUP_OK}
        assert broad <= allowed, (stage, broad - allowed)


def test_a_train_run_declares_no_run_setting_and_depends_on_its_own_settings_file(declared):
    """train@<run> gets its weights and training settings from data/runs/<run>.json (stage run_settings), so it
    declares none of them: only the stage's own keep_checkpoint and the device/ranks."""
    for run in _train_runs():
        keys = declared[f"train@{run}"]
        assert not [k for k in keys if k.split(".")[0] in ("loss", "runs", "model")], (run, keys)
        assert [k for k in keys if k.startswith("train.")] == ["train.keep_checkpoint"], (run, keys)
    assert {"loss", "runs", "train", "model.precision"} == set(declared["run_settings"])


def test_a_runs_settings_are_its_methods_constructor_arguments():
    """Every key of `runs.<run>` but `method` is a constructor argument of its method, so no setting is ignored."""
    for run, item in _train_runs().items():
        names = set(inspect.signature(get_method(item["method"]).__init__).parameters) - {"self"}
        assert set(item) - {"method"} <= names, (run, set(item) - {"method"} - names)


def _nest(keys: list[str]) -> dict:
    out: dict = {}
    for key in keys:
        node = out
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = _lookup(key)
    return out


def test_run_settings_reads_every_key_it_declares_and_each_run_builds_its_method(declared):
    """The resolver stage's own param-reading path with a recording StageParams (what check_all_read enforces)."""
    params = _common.StageParams("run_settings", _nest(declared["run_settings"]))
    runs = run_settings_stage.resolved(params)
    params.check_all_read()
    assert set(runs) == set(_train_runs())
    for run in runs.values():
        get_method(run["method"])(**run["config"])      # every resolved key is a constructor argument


def test_each_train_run_reads_every_key_it_declares(declared):
    for run in _train_runs():
        params = _common.StageParams(f"train@{run}", _nest(declared[f"train@{run}"]))
        params["train.keep_checkpoint"]             # compute.* is the hardware: read by no declared param
        params.check_all_read()


def test_only_the_resolver_declares_loss_or_training_keys(declared):
    for stage, keys in declared.items():
        if stage.startswith("train@"):              # its own keep_checkpoint (above)
            continue
        assert not [k for k in keys
                    if k.split(".")[0] in ("loss", "train", "runs") and (stage, k) not in WHOLE_GROUP_OK], \
            stage


HOST_COUNT_KEYS = ("workers", "threads")      # clipfinetune/host.py: the host's, never params


def _keys(tree, prefix=""):
    """Every dotted key of a nested mapping, groups included."""
    for key, value in (tree or {}).items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _keys(value, f"{prefix}{key}.")


def test_no_worker_or_thread_count_is_a_declared_param_of_any_stage(declared):
    """Worker and thread counts change no output, so a host's setting must re-run nothing: no stage declares one,
    and no group a stage declares whole holds one (params.yaml, params.real.yaml, every recipe)."""
    for stage, keys in declared.items():
        assert not [k for k in keys if k.split(".")[-1] in HOST_COUNT_KEYS], (stage, keys)
    for path in [ROOT / "params.yaml", ROOT / "params.real.yaml", *sorted((ROOT / "recipes").glob("*.yaml"))]:
        found = [k for k in _keys(yaml.safe_load(path.read_text())) if k.split(".")[-1] in HOST_COUNT_KEYS]
        assert not found, (path.name, found)


def test_an_older_params_files_worker_count_reaches_no_runs_settings():
    """A user's params.yaml that still sets `train.workers` (shared or a method's) trains as before: the key is
    dropped, not an error, and is in no run's settings file (which train@<run> depends on)."""
    from clipfinetune.runs import resolve_runs

    params = {**PARAMS, "train": {**PARAMS["train"], "workers": 8, "clip": {"workers": 3}}}
    with_old = resolve_runs(params)
    assert with_old == resolve_runs(PARAMS)
    assert all("workers" not in settings["train"] for settings in with_old.values())
