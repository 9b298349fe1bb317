"""The evaluation sets' older params spelling `eval.benchmarks` still reads as `eval.evalsets` (clipfinetune/keys.py
`respell`, called by every reader of a params or profile file): a recipe, a profile or a params.yaml that names it
gives what the current spelling gives, the profile commands write the current one, and a file that names both is
refused with both keys and the file named."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clipfinetune.keys import BothSpellings, respell

ROOT = Path(__file__).resolve().parents[1]


def older(text: str) -> str:
    """A params/profile text as it was written before the rename: `eval:`'s `evalsets:` key spelled `benchmarks:`."""
    new, n = re.subn(r"^  evalsets:", "  benchmarks:", text, flags=re.MULTILINE)
    assert n == 1, "one eval.evalsets group per file"
    return new


def run(cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, check=False,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    if check and proc.returncode:
        raise AssertionError(f"{args} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def sandbox(root: Path, spelled=lambda text: text) -> Path:
    """A git repo with the committed params.yaml, params.real.yaml and recipes/, each text passed through `spelled`."""
    root.mkdir()
    (root / "recipes").mkdir()
    files = ["params.yaml", "params.real.yaml", *(f"recipes/{p.name}" for p in (ROOT / "recipes").glob("*.yaml"))]
    for name in files:
        text = (ROOT / name).read_text()
        (root / name).write_text(spelled(text) if re.search(r"^  evalsets:", text, re.MULTILINE) else text)
    run(root, "git", "init", "-q")
    run(root, "git", "add", "-A")
    run(root, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "base")
    return root


def test_respell_moves_the_older_key_in_place_and_leaves_a_current_file_alone():
    tree = {"eval": {"batch_size": 8, "benchmarks": {"zeroshot": {}}, "report": {"set": "x"}}, "runs": {}}
    respell(tree)
    assert list(tree["eval"]) == ["batch_size", "evalsets", "report"]        # the key's place kept
    assert tree["eval"]["evalsets"] == {"zeroshot": {}}
    again = {"eval": {"evalsets": {"zeroshot": {}}}, "benchmarks": {"not": "the eval group"}}
    assert respell(again) == {"eval": {"evalsets": {"zeroshot": {}}}, "benchmarks": {"not": "the eval group"}}
    assert respell({"eval": None}) == {"eval": None}


def test_a_recipe_in_the_older_spelling_writes_what_the_current_one_writes(tmp_path):
    current = sandbox(tmp_path / "current")
    old = sandbox(tmp_path / "old", older)
    assert "  benchmarks:" in (old / "recipes" / "goal.yaml").read_text()
    for repo in (current, old):
        run(repo, sys.executable, "-m", "clipfinetune.project.profile", "recipe", "goal")
    written = (old / "params.yaml").read_text()
    assert yaml.safe_load(written) == yaml.safe_load((current / "params.yaml").read_text())
    assert "benchmarks:" not in written and "eval.benchmarks" not in written


def test_a_params_yaml_in_the_older_spelling_is_rewritten_by_apply_with_its_comment(tmp_path):
    repo = sandbox(tmp_path / "repo", older)
    params = repo / "params.yaml"
    before = yaml.safe_load(params.read_text())
    profile = repo / "mine.yaml"
    profile.write_text("eval:\n  benchmarks:\n    retrieval:\n      mine: {karpathy: k.json, images: imgs}\n")
    run(repo, sys.executable, "-m", "clipfinetune.project.profile", "apply", "mine.yaml")
    text = params.read_text()
    after = yaml.safe_load(text)
    assert "benchmarks" not in after["eval"]
    assert list(after["eval"]) == [("evalsets" if k == "benchmarks" else k) for k in before["eval"]]
    assert after["eval"]["evalsets"]["retrieval"] == {"mine": {"karpathy": "k.json", "images": "imgs"}}  # whole
    assert {k: v for k, v in after["eval"]["evalsets"].items() if k != "retrieval"} == \
        {k: v for k, v in before["eval"]["benchmarks"].items() if k != "retrieval"}
    comment = re.search(r"^  benchmarks: +(#.*)$", older((ROOT / "params.yaml").read_text()), re.MULTILINE).group(1)
    assert re.search(rf"^  evalsets: +{re.escape(comment)}$", text, re.MULTILINE), "the key's comment moved with it"


def test_both_spellings_in_one_file_are_refused_naming_the_file_and_both_keys(tmp_path):
    repo = sandbox(tmp_path / "repo")
    params = repo / "params.yaml"
    unchanged = params.read_text()
    (repo / "both.yaml").write_text("eval:\n  benchmarks: {zeroshot: {}}\n  evalsets: {aro: {}}\n")
    proc = run(repo, sys.executable, "-m", "clipfinetune.project.profile", "apply", "both.yaml", check=False)
    assert proc.returncode == 1
    assert "both.yaml" in proc.stderr and "eval.benchmarks" in proc.stderr and "eval.evalsets" in proc.stderr
    assert params.read_text() == unchanged
    with pytest.raises(BothSpellings, match="params.yaml: both eval.benchmarks"):
        respell({"eval": {"benchmarks": {}, "evalsets": {}}}, "params.yaml")


def test_validate_reads_a_params_yaml_in_the_older_spelling_as_the_current_one(tmp_path, monkeypatch, capsys):
    """`python -m clipfinetune.project.validate` checks what the current spelling gives (its checks themselves:
    test_recipes); a params.yaml with both spellings is one MISSING line naming both."""
    from clipfinetune.project import validate

    checked = []
    monkeypatch.setattr(validate, "check", lambda params, root, timeout: checked.append(params) or [])
    params = tmp_path / "params.yaml"
    for spelled in (lambda text: text, older):
        params.write_text(spelled((ROOT / "params.yaml").read_text()))
        assert validate.main(["--params", str(params)]) == 0
    assert checked[0] == checked[1] and "evalsets" in checked[1]["eval"]
    capsys.readouterr()
    params.write_text("eval:\n  benchmarks: {}\n  evalsets: {}\n")
    assert validate.main(["--params", str(params)]) == 1
    assert capsys.readouterr().out.startswith(f"MISSING  {params}: both eval.benchmarks")
