"""The paper recipes: `clipfinetune recipe <paper>` writes params.yaml = the committed params.yaml + params.real.yaml +
recipes/<paper>.yaml. Checked here:

- on the miniature real-layout tree (`tests/fixtures/real_tree.py`), each recipe validates clean and its DAG (`dvc stage
  list`, and `dvc repro --dry --force`: every stage it would run) holds that paper's stages and no other, never the
  sample world's, and scores no set under data/sample; so a recipe cannot rot;
- recipes applied in every order give the params of each alone (nothing of an earlier recipe left over), over a
  params.yaml in any form `dvc exp run -S` leaves, with the user's edits kept or named; the written file loads;
- leaks are refused by `validate` and by the `shards` stage (a training set holding an evaluation image by COCO id, or
  a renamed copy of one by its bytes).
"""
from __future__ import annotations

import copy
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml
from fixtures import real_tree
from fixtures.llm import openai_server
from fixtures.profiles import unknown_keys
from fixtures.project import committed, committed_params, copy_project, run, write_params

from clipfinetune.project import profile

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("harmoclip", "fsc_clip", "goal", "degla", "mulclip")
# each paper's own run and the ablations of its tables (params.yaml's sample world trains every run of every paper)
PAPER_RUNS = {"harmoclip": {"harmoclip"}, "fsc_clip": {"fsc_clip", "fsc_lhn_only", "fsc_global_only"},
              "goal": {"goal", "goal_global_only"}, "degla": {"degla", "degla_no_distill"},
              "mulclip": {"mulclip", "mulclip_global_only"}}
# the data stages each paper's runs read (dvc.yaml runs `<stage>@<source>` for each listed source), and no other
PAPER_DATA_STAGES = {"harmoclip": {"word_regions@coco"}, "fsc_clip": set(), "degla": {"negatives@coco"},
                     "goal": {"sentences@docci", "segments@docci", "lism@docci"}, "mulclip": {"sentences@docci"}}
# what every paper needs besides: the base weights, the method code digests, shards, the evaluation-set manifest, the
# base's evaluation and the report (no sample world: nothing of a real run reads data/sample)
EVERY_RECIPE = {"plan@repro", "pretrain", "code", "run_settings", "shards", "evalsets", "eval_base", "report"}
WEIGHTS = "datasets/weights/clip-tiny"          # stands in for every pretrained checkpoint (and LISM's matcher)
# the compute and service stand-ins of a CPU test: no path or layout of a recipe is changed
CPU = {"model": {"pretrained": f"local-dir:{WEIGHTS}"}, "segments": {"sam_checkpoint": ""}}
# train2017 as the training corpus: holds the Karpathy test image 42 (same COCO id, same bytes as its val2014 file)
TRAIN2017 = {"sources": {"coco": {"captions": "datasets/coco/annotations/captions_train2017.json",
                                  "instances": "datasets/coco/annotations/instances_train2017.json",
                                  "images": "datasets/coco/train2017"}}}


def _commit(repo: Path, message: str) -> None:
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("recipes") / "project")
    real_tree.build(repo)
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    run(repo, "git", "init", "-q")
    _commit(repo, "recipes")
    with openai_server(reply=lambda prompt: "") as (base_url, _):
        yield {"repo": repo, "base_url": base_url}


def _apply(project, paper: str | None = None, extra: dict | None = None) -> dict:
    """params.yaml = the committed (sample) params + `clipfinetune recipe <paper>` (or, without a paper, the real
    base alone) + the CPU stand-ins (+ extra); returns the result."""
    repo = project["repo"]
    run(repo, "git", "checkout", "--", "params.yaml")
    if paper:
        out = run(repo, "clipfinetune", "recipe", paper).stdout
        assert "replaced" not in out and "kept" not in out, out          # a clean workspace: no edit to report
    else:
        run(repo, "python", "-m", "clipfinetune.project.profile", "apply", "params.real.yaml")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    stand_ins = {**CPU, "negatives": {"base_url": project["base_url"]}}
    if params["lism"]["model"] != "models/base":
        stand_ins["lism"] = {"model": WEIGHTS, "pretrained": ""}
    profile.deep_merge(stand_ins, extra or {})
    write_params(repo, stand_ins)
    return yaml.safe_load((repo / "params.yaml").read_text())


def _validate(project):
    return run(project["repo"], "python", "-m", "clipfinetune.project.validate", "--timeout", "2", check=False)


def _paths(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _paths(v)
    elif isinstance(node, str) and "/" in node:
        yield node


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
def test_each_recipe_validates_clean_and_its_dag_holds_its_papers_stages_only(project, recipe):
    params = _apply(project, recipe)
    out = _validate(project)
    assert out.returncode == 0, out.stdout
    assert "LEAKAGE" not in out.stdout and "0 overlapping" in out.stdout
    assert params["eval"]["report"]["paper"] == recipe
    runs = {f"{s}@{r}" for r in PAPER_RUNS[recipe] for s in ("train", "eval")}
    needed = EVERY_RECIPE | PAPER_DATA_STAGES[recipe] | runs
    dag = set(run(project["repo"], "dvc", "stage", "list", "--name-only").stdout.split())
    assert dag == needed, sorted(dag ^ needed)                          # never sample@world
    plan = run(project["repo"], "dvc", "repro", "--dry", "--force")      # --force: every stage it would run
    assert set(re.findall(r"Running stage '([^']+)'", plan.stdout)) == needed, plan.stdout[-2000:]
    scored = list(_paths(params["eval"]["evalsets"]))
    assert scored and not [p for p in scored if p.startswith("data/sample")]


# the data stages of dvc.yaml (`foreach: ${<stage>.sources}`): each recipe names the sources of every one
DATA_STAGES = sorted(name for name, body in yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"].items()
                     if body.get("foreach") == f"${{{name}.sources}}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_names_every_data_stages_sources_only_known_keys_and_cites_every_value(recipe):
    params = committed_params()
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text()
    own = yaml.safe_load(text)
    assert set(DATA_STAGES) == {"word_regions", "sentences", "segments", "lism", "negatives"}
    for key in [f"{stage}.sources" for stage in DATA_STAGES] + ["shards.sources", "shards.splits"]:
        assert isinstance(profile._get(own, key), list), f"recipes/{recipe}.yaml does not name {key}"
    assert unknown_keys(own, params) == []
    assert set(own["runs"]) == PAPER_RUNS[recipe]                       # its runs, no other paper's
    train = own["train"][recipe]
    for line in text.splitlines():                     # each training value carries its source on its line
        key = line.strip().split(":")[0]
        if line.startswith("    ") and key in train and not line.strip().startswith("#"):
            assert "#" in line, line


@pytest.mark.parametrize("recipe", (None, *RECIPES))
def test_the_real_profile_names_every_evaluation_task_and_no_sample_world_path(recipe):
    """A profile replaces a task's sets whole, and the real base names every task: no sample-world set survives on a
    real model, and no stage of the applied params reads data/sample."""
    files = [ROOT / "params.real.yaml"] + ([ROOT / "recipes" / f"{recipe}.yaml"] if recipe else [])
    applied = profile.merged(files)
    assert set(applied["eval"]["evalsets"]) == set(committed_params()["eval"]["evalsets"])
    assert applied["sample"]["build"] == []                             # stage sample@world is not in the DAG
    full = profile.layered(committed_params(), *(yaml.safe_load(f.read_text()) for f in files))
    assert [p for p in _paths({k: v for k, v in full.items() if k != "sample"}) if p.startswith("data/sample")] == []


# ------------------------------------------------------------------------------------ order, edits, DVC's -S form
def _layered(*layers: dict) -> dict:
    """The intended params: each key from the last layer that sets it; `runs` and a task's sets
    `eval.evalsets.<task>` from the last layer that names them, whole."""
    out = copy.deepcopy(layers[0])
    for layer in layers[1:]:
        def walk(dst, src, path):
            for k, v in src.items():
                whole = path + (k,) == ("runs",) or len(path) == 2 and path == ("eval", "evalsets")
                if isinstance(v, dict) and v and isinstance(dst.get(k), dict) and not whole:
                    walk(dst[k], v, path + (k,))
                else:
                    dst[k] = copy.deepcopy(v)
        walk(out, layer, ())
    return out


@pytest.fixture()
def sandbox(tmp_path):
    """A git repo holding the committed params.yaml and the workspace's params.real.yaml and recipes/."""
    (tmp_path / "params.yaml").write_text(committed("params.yaml"))
    shutil.copy(ROOT / "params.real.yaml", tmp_path / "params.real.yaml")
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    run(tmp_path, "git", "init", "-q")
    _commit(tmp_path, "sample world")
    return tmp_path


def _alone(paper: str) -> dict:
    load = lambda p: yaml.safe_load(Path(p).read_text())
    return _layered(committed_params(), load(ROOT / "params.real.yaml"), load(ROOT / "recipes" / f"{paper}.yaml"))


def _loaded(root: Path) -> dict:
    return yaml.safe_load((root / "params.yaml").read_text())


def test_recipes_in_every_order_give_the_params_of_each_alone(sandbox):
    for b in RECIPES:
        run(sandbox, "git", "checkout", "--", "params.yaml")
        profile.recipe(b, sandbox / "params.yaml")
        assert _loaded(sandbox) == _alone(b), b
        assert profile.recipe(b, sandbox / "params.yaml")["replaced"] == {}     # idempotent, nothing reported
        assert _loaded(sandbox) == _alone(b)
        for a in RECIPES:
            if a != b:
                run(sandbox, "git", "checkout", "--", "params.yaml")
                profile.recipe(a, sandbox / "params.yaml")
                out = profile.recipe(b, sandbox / "params.yaml")
                assert _loaded(sandbox) == _alone(b), (a, b)
                assert out["replaced"] == {} and out["kept"] == {}      # a recipe's values are no user edit


def test_harmoclip_then_goal_keeps_goals_local_pairs():
    """The order bug: HarmoCLIP's `sentences/segments/lism.sources: []` must not survive GOAL."""
    goal = _alone("goal")
    assert (goal["sentences"]["sources"], goal["segments"]["sources"], goal["lism"]["sources"]) == \
        (["docci"], ["docci"], ["docci"])
    assert goal["word_regions"]["sources"] == [] and goal["eval"]["box_cls"]["text_encoder"] == "own"


def _dvc_set_param(path: Path, *overrides: str) -> None:
    """What `dvc exp run -S` does to params.yaml (DVC's own code path: dvc.repo.experiments -> apply_overrides)."""
    from dvc.utils.hydra import apply_overrides

    apply_overrides(str(path), list(overrides))


def test_dvc_set_param_rewrites_the_file_as_the_bug_needed():
    """The form `-S` leaves (block lists, comments moved into them): ruamel merged into it once wrote
    `shards: maxcount: 5000` on one line (yaml.scanner.ScannerError)."""
    text = committed("params.yaml")
    assert re.search(r"^  sources: \[coco\]", text, re.MULTILINE)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "params.yaml"
        path.write_text(text)
        _dvc_set_param(path, "loss.lambda_l=0.2")
        rewritten = path.read_text()
    assert re.search(r"^  sources: +#.*\n(?: +#.*\n|\n)*  - coco$", rewritten, re.MULTILINE)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_over_params_rewritten_by_dvc_set_param_loads_keeps_or_names_the_edits(sandbox, recipe):
    params = sandbox / "params.yaml"
    _dvc_set_param(params, "loss.lambda_l=0.2", "compute.nproc=4", "negatives.sources=[]")
    out = profile.recipe(recipe, params)
    want = _alone(recipe)
    want["compute"]["nproc"] = 4                                        # no recipe sets compute: the edit is kept
    assert _loaded(sandbox) == want
    assert out["kept"] == {"compute.nproc": 4}
    replaced = {"loss.lambda_l": (0.2, profile._get(want, "loss.lambda_l", profile.ABSENT)),
                "negatives.sources": ([], want["negatives"]["sources"])}
    assert out["replaced"] == {k: v for k, v in replaced.items() if v[0] != v[1]}    # what the recipe changed
    assert ("loss.lambda_l" in out["replaced"]) == (recipe != "fsc_clip")     # FSC-CLIP's is 0.2 too
    assert "# the embedded sample world" in params.read_text()          # the committed file's comments
    again = profile.recipe(recipe, params)                              # idempotent over its own output
    assert _loaded(sandbox) == want and again["kept"] == {"compute.nproc": 4}


@pytest.mark.parametrize("recipe", RECIPES)
def test_apply_over_params_rewritten_by_dvc_set_param_loads_and_equals_the_intended_merge(tmp_path, recipe):
    load = lambda p: yaml.safe_load(Path(p).read_text())
    params = tmp_path / "params.yaml"
    params.write_text(committed("params.yaml"))
    _dvc_set_param(params, "loss.lambda_l=0.2")
    edited = load(params)
    profile.apply([ROOT / "params.real.yaml", ROOT / "recipes" / f"{recipe}.yaml"], params)
    assert load(params) == _layered(edited, load(ROOT / "params.real.yaml"), load(ROOT / "recipes" / f"{recipe}.yaml"))
    assert "# the embedded sample world" in params.read_text()


def test_a_committed_recipe_is_not_the_base_of_the_next(sandbox):
    """A user commits an applied recipe (say, to queue it): the next recipe starts from the last sample-world
    params.yaml of the history, not from that commit, and names it."""
    first = run(sandbox, "git", "rev-parse", "--short", "HEAD").stdout.strip()
    profile.recipe("harmoclip", sandbox / "params.yaml")
    _dvc_set_param(sandbox / "params.yaml", "loss.lambda_gr=0.5")      # committed in DVC's form too
    _commit(sandbox, "harmoclip")
    out = profile.recipe("goal", sandbox / "params.yaml")
    assert out["base"] == first and _loaded(sandbox) == _alone("goal")
    profile.recipe("goal", sandbox / "params.yaml", base_ref="HEAD")   # the base named: HEAD's, DVC's form
    assert _loaded(sandbox)["eval"]["report"]["paper"] == "goal"


def test_an_unknown_paper_is_refused_naming_the_recipes(sandbox):
    with pytest.raises(SystemExit, match=r"no recipe 'clip'.*harmoclip"):
        profile.recipe("clip", sandbox / "params.yaml")


def test_the_command_reports_what_it_replaced_and_the_next_steps(sandbox):
    _dvc_set_param(sandbox / "params.yaml", "loss.lambda_l=0.3", "compute.nproc=4")
    proc = run(sandbox, "clipfinetune", "recipe", "fsc_clip", check=False)
    assert proc.returncode == 0, proc.stderr
    assert "kept 1 workspace edit(s)" in proc.stdout and "compute.nproc: 4" in proc.stdout
    assert "loss.lambda_l: 0.3 -> 0.2" in proc.stdout and "-S 'loss.lambda_l=0.3'" in proc.stdout
    assert "next: clipfinetune plan, then dvc exp run -n fsc_clip" in proc.stdout


def test_a_text_that_does_not_load_back_is_never_written(tmp_path, monkeypatch):
    """Should ruamel's round trip ever emit a text that does not load back equal, the values win over the comments."""
    round_trip = profile._yaml

    def broken():                                   # the round-trip writer, with a line that does not load
        y = round_trip()
        dump = y.dump
        y.dump = lambda data, stream: (dump(data, stream), stream.write("shards: maxcount: 1\n"))
        return y

    monkeypatch.setattr(profile, "_yaml", broken)
    params = tmp_path / "params.yaml"
    params.write_text(committed("params.yaml"))
    profile.apply([ROOT / "params.real.yaml"], params)
    monkeypatch.undo()
    assert yaml.safe_load(params.read_text()) == _layered(committed_params(),
                                                          yaml.safe_load((ROOT / "params.real.yaml").read_text()))


def test_a_profile_replaces_runs_and_each_tasks_sets_whole_and_merges_the_rest(tmp_path):
    base = tmp_path / "params.yaml"
    base.write_text("runs:\n  clip: {method: clip}\n  goal: {method: goal, lambda_tsl: 1.0}\n"
                    "train:\n  lr: 1.0\n  epochs: 2\n"
                    "eval:\n  evalsets:\n    retrieval:\n      sample: {karpathy: a.json, images: a}\n"
                    "      real: {karpathy: k.json, images: coco}\n    aro:\n      real: {dir: aro}\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("runs:\n  goal: {method: goal, lambda_tsl: 0.5}\ntrain:\n  lr: 2.0\n"
                      "eval:\n  evalsets:\n    retrieval:\n      real: {coco_captions: c.json, images: val}\n")
    profile.apply([recipe], base)
    assert yaml.safe_load(base.read_text()) == {
        "runs": {"goal": {"method": "goal", "lambda_tsl": 0.5}}, "train": {"lr": 2.0, "epochs": 2},
        "eval": {"evalsets": {"retrieval": {"real": {"coco_captions": "c.json", "images": "val"}},
                                "aro": {"real": {"dir": "aro"}}}}}


def _metric_names(task: str) -> set[str]:
    """The leaf names the evaluators write for a task (clipfinetune/eval/suite.py's output keys)."""
    from clipfinetune.data.evalsets.compositionality import SUGARCREPE_TASKS
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
    evalsets = profile.merged([ROOT / "params.real.yaml", ROOT / "recipes" / f"{recipe}.yaml"])["eval"]["evalsets"]
    assert set(entry["models"]) <= {recipe, "base"} | ABLATIONS.get(recipe, set())
    for rows in entry["models"].values():
        assert len({r["metric"] for r in rows}) == len(rows)
        for r in rows:
            parts = r["metric"].split(".")
            task, name, leaf = parts[-3:]
            assert r["source"] and 0 <= r["value"] <= 100, r
            assert leaf in _metric_names(task), r["metric"]
            assert evalsets[task][name], f"{r['metric']}: set {task}.{name} is off in the recipe"


# ------------------------------------------------------------------------------------------------- leakage
def test_the_real_base_trains_on_train2014_and_validates_without_leaks(project):
    _apply(project)
    out = _validate(project)
    assert out.returncode == 0, out.stdout
    assert "0 overlapping" in out.stdout


def test_train2017_beside_the_karpathy_test_is_refused_by_validate(project):
    _apply(project, extra=TRAIN2017)
    out = _validate(project)
    assert out.returncode == 1
    lines = [ln for ln in out.stdout.splitlines() if "LEAKAGE" in ln]
    assert any(ln.startswith("MISSING  eval.evalsets.retrieval.real: LEAKAGE evaluation set retrieval.real: "
                             "1 of its images are training images - 1 by COCO id (first: 42), 1 by content (first: "
                             "datasets/coco/train2017/000000000042.jpg == datasets/coco/val2014/COCO_val2014_"
                             "000000000042.jpg)") for ln in lines), out.stdout     # one image, the same bytes
    assert any("eval.evalsets.aro.real" in ln and "first: 42" in ln for ln in lines)     # COCO-Order's list
    assert not any("sugarcrepe" in ln or "box_cls" in ln for ln in lines)                  # val2017: disjoint


def test_a_renamed_copy_of_an_evaluation_image_in_training_is_refused_by_content(project):
    repo = project["repo"]
    docci_train = repo / "datasets" / "docci" / "images" / "train_00001.jpg"
    original = docci_train.read_bytes()
    try:
        shutil.copyfile(repo / "datasets" / "coco" / "val2017" / "000000000139.jpg", docci_train)
        _apply(project)
        out = _validate(project)
    finally:
        docci_train.write_bytes(original)
    assert out.returncode == 1
    for where in ("box_cls.real", "sugarcrepe.real"):      # both score val2017/000000000139.jpg
        assert f"LEAKAGE evaluation set {where}: 1 of its images are training images - 1 by content (first: " \
               f"datasets/docci/images/train_00001.jpg == datasets/coco/val2017/000000000139.jpg)" in out.stdout


def test_the_shards_stage_refuses_a_leaky_training_set(project):
    _apply(project, extra=TRAIN2017)
    proc = run(project["repo"], "python", "stages/shards.py", "--stage", "shards", check=False)
    assert proc.returncode != 0
    assert "LeakageError" in proc.stderr and "evaluation set retrieval.real" in proc.stderr
    assert "by COCO id (first: 42)" in proc.stderr
    assert not (project["repo"] / "data" / "shards").exists()
