"""dvc.yaml's code deps are each stage's import closure (clipfinetune/deps.py), both ways: a file a stage imports is
a dep (an edit re-runs it), a file it does not import is not (an edit leaves it alone). After a merge, the exact
difference is printed here and `python -m clipfinetune.deps --write` rewrites the lists."""
from __future__ import annotations

import modulefinder
from pathlib import Path

import pytest
import yaml

from clipfinetune import deps

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())


def test_every_stages_code_deps_are_its_import_closure():
    diff = deps.diff(DVC)
    report = "".join(f"\n{name}: missing {missing}, in excess {extra}" for name, (missing, extra) in diff.items())
    assert not diff, "run `python -m clipfinetune.deps --write`:" + report


def _modulefinder_files(script: str) -> set[str]:
    """The project's .py files Python's own ModuleFinder sees `script` import (its bytecode, nested functions
    included), searching only the repository so third-party packages are never scanned. Folders of the repository
    that are no package (a run's dvclive/, models/, ...) are excluded: ModuleFinder would take `from dvclive import`
    for that folder as a namespace package and crash on it."""
    not_packages = [p.name for p in ROOT.iterdir() if p.is_dir() and not (p / "__init__.py").exists()]
    finder = modulefinder.ModuleFinder(path=[str(ROOT), str(ROOT / "stages")], excludes=not_packages)
    finder.run_script(str(ROOT / script))
    files = {Path(m.__file__).resolve() for m in finder.modules.values() if m.__file__}
    return {p.relative_to(ROOT).as_posix() for p in files if p.is_relative_to(ROOT)}


@pytest.mark.parametrize("script", ["stages/lism.py", "stages/report.py", "stages/train.py", "stages/negatives.py"])
def test_the_closure_finds_what_modulefinder_finds(script):
    found = {f for f in deps.closure(script) if f.endswith(".py")}
    assert found == _modulefinder_files(script)


def test_a_module_a_stage_does_not_import_is_not_its_dep():
    """Whole-package deps re-ran stages for files they never load: the report's plots are no dep of a training
    stage, DeGLA's LLM client none of the shards, LoRA none of the caption-only data stages."""
    bodies = {name: s.get("do", s) for name, s in DVC["stages"].items()}
    assert "clipfinetune/report/plots.py" in bodies["report"]["deps"]
    assert "clipfinetune/report/plots.py" not in bodies["train"]["deps"] + bodies["pretrain"]["deps"]
    assert "clipfinetune/data/negatives/degla/llm.py" in bodies["negatives"]["deps"]
    assert not [d for d in bodies["shards"]["deps"] if d.startswith("clipfinetune/data/negatives")]
    assert "clipfinetune/models/lora.py" not in bodies["word_regions"]["deps"] + bodies["sentences"]["deps"]


@pytest.mark.parametrize("stage", ["shards", "benchmarks"])
def test_the_stages_that_only_read_evaluation_sets_load_neither_the_evaluation_nor_the_model(stage):
    """`shards` (the leakage check) and `benchmarks` (the benchmark files) read the sets through
    clipfinetune/data/benchmarks/, below the evaluation: editing eval/ or models/ (e.g. models/lora.py) re-runs
    neither, in dvc.yaml and in the closure it is generated from."""
    body = DVC["stages"][stage]
    for files in (body["deps"], deps.closure(deps.stage_script(body))):
        assert "clipfinetune/data/benchmarks/sets.py" in files
        assert not [f for f in files if f.startswith(("clipfinetune/eval/", "clipfinetune/models/"))], stage


def test_an_edited_loss_changes_the_code_digest_of_its_method_and_the_mix_only(tmp_path, monkeypatch):
    """stage method_code's digests (data/code/<method>.json, train@<run>'s code dep) on a copy of the package:
    appending to DeGLA's loss file changes DeGLA's and the mix's, no other method's."""
    import shutil

    from clipfinetune import deps
    from clipfinetune.registry import METHODS, MIX

    shutil.copytree(ROOT / "clipfinetune", tmp_path / "clipfinetune", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(deps, "ROOT", tmp_path)
    from stages import method_code

    monkeypatch.setattr(method_code, "ROOT", tmp_path)
    digests = lambda: {m: {f: method_code.digest(f) for f in deps.method_closure(m)} for m in (*METHODS, MIX)}
    before = digests()
    assert "clipfinetune/losses/degla.py" in before["degla"] and "clipfinetune/train/loop.py" not in before["degla"]
    loss = tmp_path / "clipfinetune" / "losses" / "degla.py"
    loss.write_text(loss.read_text() + "# edited\n")
    after = digests()
    assert {m for m in before if before[m] != after[m]} == {"degla", MIX}


def test_mulclip_and_goal_share_the_long_text_helper_from_models_not_each_others_code():
    """Long-CLIP stretching lives in models/long_text.py: editing GOAL's loss or method re-trains no MulCLIP run
    (and the other way round); both runs still follow an edit of the shared helper."""
    mulclip, goal = set(deps.method_closure("mulclip")), set(deps.method_closure("goal"))
    assert not [f for f in mulclip if "goal" in f] and not [f for f in goal if "mulclip" in f]
    assert "clipfinetune/models/long_text.py" in mulclip & goal
