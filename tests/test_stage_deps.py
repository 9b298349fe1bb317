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
    included), searching only the repository so third-party packages are never scanned."""
    finder = modulefinder.ModuleFinder(path=[str(ROOT), str(ROOT / "stages")])
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
