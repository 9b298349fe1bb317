"""The paper recipes (recipes/<method>.yaml over params.real.yaml) on the miniature real-layout tree: each validates
clean and plans its run (`dvc repro --dry --force`: every stage, no data needed), which holds that paper's stages
and no other, so a recipe cannot rot; and leaks are refused by `validate` and by the
`shards` stage (a training set holding an evaluation image by COCO id, or a renamed copy of one by its bytes).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml
from fixtures import real_tree
from fixtures.llm import openai_server
from fixtures.profiles import unknown_keys
from fixtures.project import copy_project, run, write_params

from clipfinetune import profile

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("harmoclip", "fsc_clip", "goal", "degla", "mulclip")
# each paper's own run and the ablations of its tables (params.yaml's sample world trains every run of every paper)
PAPER_RUNS = {"harmoclip": {"harmoclip"}, "fsc_clip": {"fsc_clip", "fsc_lhn_only", "fsc_global_only"},
              "goal": {"goal", "goal_global_only"}, "degla": {"degla", "degla_no_distill"},
              "mulclip": {"mulclip", "mulclip_global_only"}}
# the data stages each paper's runs read (dvc.yaml runs `<stage>@<source>` for each listed source), and no other
PAPER_DATA_STAGES = {"harmoclip": {"word_regions@coco"}, "fsc_clip": set(), "degla": {"negatives@coco"},
                     "goal": {"sentences@docci", "segments@docci", "lism@docci"}, "mulclip": {"sentences@docci"}}
EVERY_RECIPE = {"sample", "pretrain", "method_code", "run_settings", "shards", "benchmarks", "eval_base", "report"}
WEIGHTS = "datasets/weights/clip-tiny"          # stands in for every pretrained checkpoint (and LISM's matcher)
# the compute and service stand-ins of a CPU test: no path or layout of a recipe is changed
CPU = {"model": {"pretrained": f"local-dir:{WEIGHTS}"}, "segments": {"sam_checkpoint": ""}}
# train2017 as the training corpus: holds the Karpathy test image 42 (same COCO id, same bytes as its val2014 file)
TRAIN2017 = {"sources": {"coco": {"captions": "datasets/coco/annotations/captions_train2017.json",
                                  "instances": "datasets/coco/annotations/instances_train2017.json",
                                  "images": "datasets/coco/train2017"}}}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("recipes") / "project")
    real_tree.build(repo)
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    shutil.copy(repo / "params.yaml", repo / "params.sample.yaml")
    run(repo, "git", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "recipes")
    with openai_server(reply=lambda prompt: "") as (base_url, _):
        yield {"repo": repo, "base_url": base_url}


def _apply(project, *profiles, extra: dict | None = None) -> dict:
    """params.yaml = the sample params + the profiles + the CPU stand-ins (+ extra); returns the result."""
    repo = project["repo"]
    shutil.copy(repo / "params.sample.yaml", repo / "params.yaml")
    run(repo, "python", "-m", "clipfinetune.profile", "apply", *profiles)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    stand_ins = {**CPU, "negatives": {"base_url": project["base_url"]}}
    if params["lism"]["model"] != "models/base":
        stand_ins["lism"] = {"model": WEIGHTS, "pretrained": ""}
    profile.deep_merge(stand_ins, extra or {})
    write_params(repo, stand_ins)
    return yaml.safe_load((repo / "params.yaml").read_text())


def _validate(project):
    return run(project["repo"], "python", "-m", "clipfinetune.validate", "--timeout", "2", check=False)


def test_fsc_clips_corpus_is_karpathy_train_and_restval_minus_val2017(project):
    """The recipe's `coco_karpathy` source, read as the shards stage selects it (its `shards.splits`)."""
    import contextlib

    from clipfinetune import leakage

    params = profile.merged([ROOT / "params.real.yaml", ROOT / "recipes" / "fsc_clip.yaml"])
    name = "coco_karpathy"
    assert name in params["shards"]["sources"]
    with contextlib.chdir(project["repo"]):
        refs = leakage.training_images({name: params["sources"][name]}, params["shards"]["splits"])
    expected = {c for c, s, _ in real_tree.KARPATHY_COCO if s in ("train", "restval")} - set(real_tree.COCO_VAL)
    assert {r.coco_id for r in refs} == expected and 285 not in expected | {r.coco_id for r in refs}
    assert {Path(r.path).parts[-2] for r in refs} == {"train2014", "val2014"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_validates_clean_and_plans_its_run(project, recipe):
    params = _apply(project, "params.real.yaml", f"recipes/{recipe}.yaml")
    out = _validate(project)
    assert out.returncode == 0, out.stdout
    assert "LEAKAGE" not in out.stdout and "0 overlapping" in out.stdout
    assert params["eval"]["report"]["paper"] == recipe
    plan = run(project["repo"], "dvc", "repro", "--dry", "--force")      # --force: plan every stage
    planned = set(re.findall(r"Running stage '([^']+)'", plan.stdout))
    runs = {f"{s}@{r}" for r in PAPER_RUNS[recipe] for s in ("train", "eval")}
    assert planned == EVERY_RECIPE | PAPER_DATA_STAGES[recipe] | runs, plan.stdout[-2000:]


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_names_only_keys_params_yaml_has_and_cites_every_value(recipe):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text()
    assert unknown_keys(yaml.safe_load(text), params) == []
    assert set(yaml.safe_load(text)["runs"]) == PAPER_RUNS[recipe]      # its runs, no other paper's
    train = yaml.safe_load(text)["train"][recipe]
    for line in text.splitlines():                     # each training value carries its source on its line
        key = line.strip().split(":")[0]
        if line.startswith("    ") and key in train and not line.strip().startswith("#"):
            assert "#" in line, line


def test_a_profile_replaces_runs_whole_and_merges_every_other_group(tmp_path):
    base = tmp_path / "params.yaml"
    base.write_text("runs:\n  clip: {method: clip}\n  goal: {method: goal, lambda_tsl: 1.0}\n"
                    "train:\n  lr: 1.0\n  epochs: 2\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("runs:\n  goal: {method: goal, lambda_tsl: 0.5}\ntrain:\n  lr: 2.0\n")
    profile.apply([recipe], base)
    assert yaml.safe_load(base.read_text()) == {"runs": {"goal": {"method": "goal", "lambda_tsl": 0.5}},
                                                "train": {"lr": 2.0, "epochs": 2}}
    assert profile.set_args([recipe])[:2] == ["-S", "runs={goal: {method: goal, lambda_tsl: 0.5}}"]


def _metric_names(task: str) -> set[str]:
    """The leaf names the evaluators write for a task (clipfinetune/eval/suite.py's output keys)."""
    from clipfinetune.data.benchmarks.compositionality import SUGARCREPE_TASKS
    from clipfinetune.eval.long_retrieval import LONG_KS

    both = lambda ks, fmt: {fmt.format(d, k) for d in ("i2t", "t2i") for k in ks}
    return {"retrieval": both((1, 5, 10), "{}_r{}"), "long_retrieval": both(LONG_KS, "{}_r{}"),
            "global_local": both(("",), "{}_map10{}"), "box_cls": {"top1", "top5", "macc1", "macc5"},
            "sugarcrepe": set(SUGARCREPE_TASKS), "aro": {"vg_relation", "vg_attribution", "coco_order", "flickr_order"},
            "zeroshot": {"acc1", "acc5", "mean_per_class"},
            "valse": {"existence", "plurals", "counting-hard", "counting-small-quant", "counting-adversarial",
                      "relations", "action-replacement", "actant-swap", "coreference-standard", "coreference-hard",
                      "foil-it"}}[task]


ABLATIONS = {"goal": {"goal_global_only"}, "mulclip": {"mulclip_global_only"}}   # runs of the paper's own ablations


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_papers_numbers_name_metrics_their_recipe_evaluates(recipe):
    entry = yaml.safe_load((ROOT / "recipes" / "paper_numbers.yaml").read_text())[recipe]
    benchmarks = profile.merged([ROOT / "params.real.yaml", ROOT / "recipes" / f"{recipe}.yaml"])["eval"]["benchmarks"]
    assert set(entry["models"]) <= {recipe, "base"} | ABLATIONS.get(recipe, set())
    for rows in entry["models"].values():
        assert len({r["metric"] for r in rows}) == len(rows)
        for r in rows:
            parts = r["metric"].split(".")
            task, name, leaf = parts[-3:]
            assert r["source"] and 0 <= r["value"] <= 100, r
            assert leaf in _metric_names(task), r["metric"]
            assert benchmarks[task][name], f"{r['metric']}: set {task}.{name} is off in the recipe"


# ------------------------------------------------------------------------------------------------- leakage
def test_the_real_base_trains_on_train2014_and_validates_without_leaks(project):
    _apply(project, "params.real.yaml")
    out = _validate(project)
    assert out.returncode == 0, out.stdout
    assert "0 overlapping" in out.stdout


def test_train2017_beside_the_karpathy_test_is_refused_by_validate(project):
    _apply(project, "params.real.yaml", extra=TRAIN2017)
    out = _validate(project)
    assert out.returncode == 1
    lines = [ln for ln in out.stdout.splitlines() if "LEAKAGE" in ln]
    assert any(ln.startswith("MISSING  eval.benchmarks.retrieval.real: LEAKAGE evaluation set retrieval.real: "
                             "1 of its images are training images - 1 by COCO id (first: 42), 1 by content (first: "
                             "datasets/coco/train2017/000000000042.jpg == datasets/coco/val2014/COCO_val2014_"
                             "000000000042.jpg)") for ln in lines), out.stdout     # one image, the same bytes
    assert any("eval.benchmarks.aro.real" in ln and "first: 42" in ln for ln in lines)     # COCO-Order's list
    assert not any("sugarcrepe" in ln or "box_cls" in ln for ln in lines)                  # val2017: disjoint


def test_a_renamed_copy_of_an_evaluation_image_in_training_is_refused_by_content(project):
    repo = project["repo"]
    docci_train = repo / "datasets" / "docci" / "images" / "train_00001.jpg"
    original = docci_train.read_bytes()
    try:
        shutil.copyfile(repo / "datasets" / "coco" / "val2017" / "000000000139.jpg", docci_train)
        _apply(project, "params.real.yaml")
        out = _validate(project)
    finally:
        docci_train.write_bytes(original)
    assert out.returncode == 1
    for where in ("box_cls.real", "sugarcrepe.real"):      # both score val2017/000000000139.jpg
        assert f"LEAKAGE evaluation set {where}: 1 of its images are training images - 1 by content (first: " \
               f"datasets/docci/images/train_00001.jpg == datasets/coco/val2017/000000000139.jpg)" in out.stdout


def test_the_shards_stage_refuses_a_leaky_training_set(project):
    _apply(project, "params.real.yaml", extra=TRAIN2017)
    proc = run(project["repo"], "python", "stages/shards.py", "--stage", "shards", check=False)
    assert proc.returncode != 0
    assert "LeakageError" in proc.stderr and "evaluation set retrieval.real" in proc.stderr
    assert "by COCO id (first: 42)" in proc.stderr
    assert not (project["repo"] / "data" / "shards").exists()
