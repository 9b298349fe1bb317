"""A stage's code is its script's import closure (clipfinetune/project/deps.py), both ways: a file a stage imports is
in its code digest (data/code/stages/<script>.json, stage `code`; an edit re-runs the stage), a file it does not
import is not (an edit leaves it alone). dvc.yaml lists no code file: each stage body depends on its digest, so the
file reads as the pipeline. After a merge that put code files back, `python -m clipfinetune.project.deps --write`
moves them out."""
from __future__ import annotations

import modulefinder
import shutil
from pathlib import Path

import pytest
import yaml

from clipfinetune.project import deps

ROOT = Path(__file__).resolve().parents[1]
DVC = yaml.safe_load((ROOT / "dvc.yaml").read_text())
BODIES = {name: s.get("do", s) for name, s in DVC["stages"].items()}


def test_no_stage_body_lists_a_code_file_and_each_depends_on_its_scripts_digest():
    diff = deps.diff(DVC)
    report = "".join(f"\n{name}: missing {missing}, in excess {extra}" for name, (missing, extra) in diff.items())
    assert not diff, "run `python -m clipfinetune.project.deps --write`:" + report
    for name, body in BODIES.items():
        listed = [d for d in body.get("deps", []) if isinstance(d, str)]
        assert not [d for d in listed if d.startswith(("stages/", "clipfinetune/"))], name
    assert BODIES["train"]["deps"][0] == "data/code/stages/train.json"
    assert BODIES["code"]["deps"][:2] == ["clipfinetune", "stages"] and BODIES["code"]["outs"] == ["data/code"]


def test_write_moves_listed_code_files_into_the_digest_dep(tmp_path, monkeypatch):
    """A dvc.yaml with the old lists (as a merge might bring back) is rewritten to the digest dep, data deps kept."""
    text = (ROOT / "dvc.yaml").read_text().replace(
        "        - data/code/stages/word_regions.json\n",
        "        - stages/word_regions.py\n        - clipfinetune/io.py\n")
    (tmp_path / "dvc.yaml").write_text(text)
    changes = deps.write(tmp_path / "dvc.yaml")
    assert changes == {"word_regions": (["data/code/stages/word_regions.json"],
                                        ["clipfinetune/io.py", "stages/word_regions.py"])}
    assert (tmp_path / "dvc.yaml").read_text() == (ROOT / "dvc.yaml").read_text()


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


def test_a_module_a_stage_does_not_import_is_not_in_its_code():
    """Whole-package deps re-ran stages for files they never load: the report's plots are no code of a training
    stage, DeGLA's LLM client none of the shards, LoRA none of the caption-only data stages."""
    code = {name: deps.stage_closure(deps.stage_script(body)) for name, body in BODIES.items() if "cmd" in body}
    assert "clipfinetune/report/plots.py" in code["report"]
    assert "clipfinetune/report/plots.py" not in code["train"] + code["pretrain"]
    assert "clipfinetune/data/negatives/degla/llm.py" in code["negatives"]
    assert not [d for d in code["shards"] if d.startswith("clipfinetune/data/negatives")]
    assert "clipfinetune/models/lora.py" not in code["word_regions"] + code["sentences"]
    assert "clipfinetune/data/readers" in code["word_regions"]          # a source's reader loads by name: all of them


@pytest.mark.parametrize("stage", ["shards", "evalsets"])
def test_the_stages_that_only_read_evaluation_sets_load_neither_the_evaluation_nor_the_model(stage):
    """`shards` (the leakage check) and `evalsets` (the evaluation-set files) read the sets through
    clipfinetune/data/evalsets/, below the evaluation: editing eval/ or models/ (e.g. models/lora.py) re-runs
    neither."""
    files = deps.stage_closure(deps.stage_script(BODIES[stage]))
    assert "clipfinetune/data/evalsets/sets.py" in files
    assert not [f for f in files if f.startswith(("clipfinetune/eval/", "clipfinetune/models/"))], stage


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    """The package and the stage scripts copied to tmp_path, `deps` pointed at the copy."""
    for folder in deps.CODE_FOLDERS:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(deps, "ROOT", tmp_path)
    return tmp_path


def _changed(before: dict, after: dict) -> set[str]:
    return {f for f in before.keys() | after.keys() if before.get(f) != after.get(f)}


def _dvc_yaml_digests() -> set[str]:
    """The stage digests dvc.yaml's stages depend on."""
    return {d for body in BODIES.values() for d in body.get("deps", [])
            if isinstance(d, str) and d.startswith("data/code/stages/")}


def test_an_edited_module_changes_the_digests_of_the_stages_that_import_it_only(package_copy):
    before = deps.code_files()
    assert {f"data/code/{f}" for f in before} >= _dvc_yaml_digests()
    llm = package_copy / "clipfinetune" / "data" / "negatives" / "degla" / "llm.py"
    llm.write_text(llm.read_text() + "# edited\n")
    changed = {f"data/code/{f}" for f in _changed(before, deps.code_files())}
    assert changed & _dvc_yaml_digests() == {"data/code/stages/negatives.json"}


def test_an_edited_loss_changes_the_code_digest_of_its_method_only(package_copy):
    """data/code/methods/<method>.json: appending to DeGLA's loss file changes DeGLA's digest, no other method's;
    a mix reaches it only through the methods it names (`methods_run`, copied into its run's settings)."""
    from clipfinetune.methods import get_method

    before = deps.code_files()
    assert "clipfinetune/losses/degla.py" in before["methods/degla.json"]
    assert "clipfinetune/train/loop.py" not in before["methods/degla.json"]
    loss = package_copy / "clipfinetune" / "losses" / "degla.py"
    loss.write_text(loss.read_text() + "# edited\n")
    assert _changed(before, deps.code_files()) == {"methods/degla.json"}
    custom = get_method("custom")
    assert "degla" in custom.methods_run({"terms": {"degla.distill": 0.005}})
    assert not {"degla", "goal"} & set(custom.methods_run({"terms": {"fsc_clip.local_hn": 0.5}}))
    assert get_method("degla").methods_run({}) == ("degla",)


def test_a_new_method_changes_no_existing_digest(package_copy):
    """Methods are discovered (clipfinetune/registry.py): adding methods/<m>.py and losses/<m>.py adds the new
    method's digest and changes no stage's and no other method's, so no existing run re-trains."""
    before = deps.code_files()
    (package_copy / "clipfinetune" / "losses" / "throwaway.py").write_text(
        "from .clip import *  # noqa: F403\n")
    (package_copy / "clipfinetune" / "methods" / "throwaway.py").write_text(
        "from clipfinetune.losses import throwaway  # noqa: F401\n\nfrom .clip import ClipMethod\n\n\n"
        "class ThrowawayMethod(ClipMethod):\n    name = \"throwaway\"\n")
    after = deps.code_files()
    assert _changed(before, after) == {"methods/throwaway.json"}
    assert "clipfinetune/losses/throwaway.py" in after["methods/throwaway.json"]


def test_mulclip_and_goal_share_the_long_text_helper_from_models_not_each_others_code():
    """Long-CLIP stretching lives in models/long_text.py: editing GOAL's loss or method re-trains no MulCLIP run
    (and the other way round); both runs still follow an edit of the shared helper."""
    mulclip, goal = set(deps.method_closure("mulclip")), set(deps.method_closure("goal"))
    assert not [f for f in mulclip if "goal" in f] and not [f for f in goal if "mulclip" in f]
    assert "clipfinetune/models/long_text.py" in mulclip & goal
