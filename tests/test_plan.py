"""`clipfinetune plan` (clipfinetune/project/plan/) without a GPU: every recipe (recipes/*.yaml over params.real.yaml
over the committed params.yaml) on the miniature real tree (tests/fixtures/real_tree.py) x 1, 2, 7, 8 GPUs passes or
refuses with the param and a fix, never a batch that stops training after the data stages; each refusal the plan
promises has a case that triggers it; the committed sample params pass on the CPU through the command line.

GPU counts are the plan's --gpus (nothing here sees a GPU); the vLLM endpoint is tests/fixtures/llm.py's fake server.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fixtures import real_tree
from fixtures.llm import openai_server, rewrite_reply
from fixtures.project import copy_project

from clipfinetune.project import plan, profile

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if p.stem != "paper_numbers")
H200 = "NVIDIA H200"


def committed(path: str) -> str:
    return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the project with the miniature real datasets, the LISM matcher's exported folder and a SAM file."""
    from clipfinetune.models import export_model, load_model

    root = copy_project(tmp_path_factory.mktemp("plan") / "project")
    counts = real_tree.build(root)
    export_model(load_model("cft-tiny-vit"), root / "datasets/weights/ViT-L-14-336-openai")
    (root / "datasets/weights/sam_vit_h_4b8939.pth").write_bytes(b"stand-in")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)          # a project is a git repository
    with openai_server(rewrite_reply(real_tree.NOUNS, real_tree.ADJECTIVES)) as (base_url, _):
        yield {"root": root, "base_url": base_url, "stages": {}, "counts": counts}


def recipe_params(tree, recipe: str, **overlay) -> tuple[dict, list]:
    """(params, DVC's stages) of `recipe` applied as README says, over the committed params.yaml; `overlay` merged
    last (as a user's edits)."""
    root = tree["root"]
    path = root / f"params-{recipe}-{len(tree['stages'])}.yaml"
    path.write_text(committed("params.yaml"))
    profile.apply([ROOT / "params.real.yaml", *([ROOT / "recipes" / f"{recipe}.yaml"] if recipe else [])], path)
    params = yaml.safe_load(path.read_text())
    params["negatives"]["base_url"] = tree["base_url"]
    profile.deep_merge(params, overlay)
    path.write_text(yaml.safe_dump(params))
    tree["stages"][path.name] = stages = plan.dag_stages(root, path)
    return params, stages


def make(tree, params, stages, gpus, **kw) -> dict:
    return plan.make_plan(params, tree["root"], plan.Hardware(gpus, kw.pop("nodes", 1), H200), stages=stages,
                          timeout=2.0, **kw)


def row(p: dict, stage: str) -> dict:
    return next(r for r in p["stages"] if r["stage"] == stage)


def refusals(p: dict, param: str | None = None) -> list[dict]:
    return [r for r in p["refusals"] if param is None or r["param"] == param]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_on_1_2_7_8_gpus_passes_or_refuses_with_the_param_and_a_fix(tree, recipe):
    params, stages = recipe_params(tree, recipe)
    training = [s.name for s in stages if s.script == "stages/train.py"]
    assert training, recipe
    for gpus in (1, 2, 7, 8):
        p = make(tree, params, stages, gpus)
        assert p["ok"] == (not p["refusals"])
        for r in p["refusals"]:
            assert r["param"] and r["message"] and r["fixes"], (recipe, gpus, r)
        # no global batch stops its run: every training stage gets ranks that split its batch evenly, on GPUs it owns
        rank_gpus = set(p["hardware"]["rank_gpus"])
        for name in training:
            t = row(p, name)
            assert t["ranks"] >= 1 and t["global_batch"] % t["ranks"] == 0, (recipe, gpus, t)
            assert t["rank_batch"] * t["ranks"] == t["global_batch"] and set(t["gpus"]) <= rank_gpus
            if rank_gpus:                            # (none: the hardware itself is refused, e.g. the vLLM card)
                assert len(t["gpus"]) == t["ranks"] <= gpus
            else:
                assert refusals(p, "compute.llm_gpus"), (recipe, gpus)
            if t["ranks"] < len(rank_gpus):          # idle GPUs are named, with batch sizes that would use them
                assert any(name in w.split(": ")[0].split(", ") and f": {t['ranks']} of {len(rank_gpus)} GPUs" in w
                           for w in p["warnings"])
        assert not [r for r in p["refusals"] if r["param"].endswith("batch_size")], (recipe, gpus)


def test_harmoclip_on_8_gpus_trains_on_5_and_names_the_idle_ones_and_the_batches_that_use_all(tree):
    params, stages = recipe_params(tree, "harmoclip")
    p = make(tree, params, stages, 8)
    t = row(p, "train@harmoclip")
    assert (t["global_batch"], t["ranks"], t["rank_batch"], t["gpus"]) == (50, 5, 10, ["0", "1", "2", "3", "4"])
    (warning,) = [w for w in p["warnings"] if w.startswith("train@harmoclip") and "idle" in w]
    assert "GPU(s) 5,6,7 idle" in warning
    assert "train.harmoclip.batch_size: 48" in warning and "train.harmoclip.batch_size: 56" in warning
    assert row(p, "eval@harmoclip")["ranks"] == 8                     # item stages take every GPU


def test_a_batch_that_does_not_split_is_refused_naming_the_param_and_the_values_that_work(tree):
    params, stages = recipe_params(tree, "harmoclip", compute={"train_nproc": 8})
    p = make(tree, params, stages, 8)
    (r,) = refusals(p, "train.harmoclip.batch_size")
    assert r["stage"] == "train@harmoclip" and "50" in r["message"]
    assert {"train.harmoclip.batch_size: 48", "train.harmoclip.batch_size: 56", "compute.train_nproc: 5",
            "compute.train_nproc: auto"} <= set(r["fixes"])
    # several nodes: the same count on each node, so 50 has no split over 4 nodes; multiples of 4 x 8 do
    params, stages = recipe_params(tree, "harmoclip")
    p = make(tree, params, stages, 8, nodes=4)
    (r,) = refusals(p, "train.harmoclip.batch_size")
    assert "train.harmoclip.batch_size: 32" in r["fixes"] and "train.harmoclip.batch_size: 64" in r["fixes"]
    assert any("torchrun on every node" in w and "dvc commit" in w for w in p["warnings"])


def test_a_stage_declaring_compute_or_a_missing_param_is_refused(tree):
    """Before compute left the DVC params, pretrain with real weights stopped on 'declared params never read:
    compute.device'; a declaration the params lack stops `dvc repro` itself."""
    params, stages = recipe_params(tree, "fsc_clip")
    stages = copy.deepcopy(stages)
    pretrain = next(s for s in stages if s.name == "pretrain")
    pretrain.declared += ["compute.device", "pretrain.no_such_key"]
    p = make(tree, params, stages, 2)
    (device,) = refusals(p, "compute.device")
    assert device["stage"] == "pretrain" and "never read" in device["message"] and "dvc.yaml" in device["fixes"][0]
    (missing,) = refusals(p, "pretrain.no_such_key")
    assert "missing params" in missing["message"]


def test_goal_without_lism_is_refused_instead_of_training_its_global_only_ablation(tree):
    """A recipe applied over another's leftovers: GOAL's runs but `lism.sources: []` (no local pairs written)."""
    params, stages = recipe_params(tree, "goal", lism={"sources": []})
    assert not [s for s in stages if s.name.startswith("lism@")]
    p = make(tree, params, stages, 8)
    (r,) = [r for r in refusals(p, "lism.sources") if r["stage"] == "train@goal"]
    assert "local pairs" in r["message"] and "global-only" in r["message"]
    assert {"lism.sources: [docci]", "segments.sources: [docci]", "sentences.sources: [docci]"} <= set(r["fixes"])
    assert not [r for r in p["refusals"] if r["stage"] == "train@goal_global_only"]   # reads no local pairs


def test_a_data_stage_no_run_reads_is_a_warning(tree):
    params, stages = recipe_params(tree, "fsc_clip", word_regions={"sources": ["coco"]})
    p = make(tree, params, stages, 1)
    assert any(w.startswith("word_regions@coco runs but no run") for w in p["warnings"])


def test_a_vllm_server_on_this_host_and_the_ranks_never_share_a_card(tree):
    params, stages = recipe_params(tree, "degla", compute={"llm_gpus": 0})
    (r,) = refusals(make(tree, params, stages, 8), "compute.llm_gpus")
    assert r["stage"] == "negatives@coco" and "same" not in r["fixes"][0]
    assert "CUDA_VISIBLE_DEVICES=7" in r["fixes"][0] and "--generation-config vllm" in r["fixes"][0]
    # the recipe keeps the last card for the server: the ranks take the other 7
    params, stages = recipe_params(tree, "degla")
    p = make(tree, params, stages, 8)
    assert not refusals(p, "compute.llm_gpus") and p["hardware"]["rank_gpus"] == [str(i) for i in range(7)]
    assert all("7" not in row(p, s.name)["gpus"] for s in stages if s.script in plan.ITEM_SCRIPTS)
    # one GPU: the server and the ranks cannot both have it
    (r,) = refusals(make(tree, params, stages, 1), "compute.llm_gpus")
    assert any(f.startswith("negatives.backend: offline") for f in r["fixes"])
    # negatives already done (the server stopped, its card given to the ranks): tests/scale/test_plan_repro.py, through
    # the real `dvc repro` and the project's dvc.lock


def test_sample_world_sets_on_a_real_model_are_refused(tree):
    params = yaml.safe_load(committed("params.yaml"))
    stages = plan.dag_stages(tree["root"], _written(tree, "sample-real", params))
    assert make(tree, params, stages, 0)["ok"]                      # the sample world's own model: fine
    params["model"]["pretrained"] = "openai"
    params["model"]["name"] = "ViT-B-16"
    (r,) = refusals(make(tree, params, stages, 0), "eval.evalsets")
    assert "eval.evalsets.retrieval.sample" in r["message"]
    assert "eval.evalsets.retrieval.sample: null" in r["fixes"] and "eval.report.set: real" in r["fixes"]


def _written(tree, name: str, params: dict) -> Path:
    path = tree["root"] / f"params-{name}.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def test_epoch_coverage_comes_from_the_loader_and_under_100_percent_is_refused(tree, monkeypatch):
    """Interface 2: with data/shards built, the loader's `epoch_coverage` gives the exact numbers (a fake here,
    called with the interface's arguments); an epoch missing units or repeating some is refused."""
    params, stages = recipe_params(tree, "fsc_clip")
    shards = tree["root"] / "data" / "shards"
    shards.mkdir(parents=True, exist_ok=True)
    (shards / "index.json").write_text("{}")
    asked = []

    def coverage(shards_dir, split, method, **kw):
        asked.append((Path(shards_dir), split, type(method).__name__, kw))
        return {"units": 1000, "steps_per_epoch": 8, "seen": 960, "repeated": 40}

    from clipfinetune.data import loader

    monkeypatch.setattr(loader, "epoch_coverage", coverage, raising=False)
    try:
        p = make(tree, params, stages, 8)
    finally:
        (shards / "index.json").unlink()
    t = row(p, "train@fsc_clip")
    assert (t["units"], t["seen"], t["repeated"], t["coverage"], t["steps_per_epoch"]) == (1000, 960, 40, "exact", 8)
    shard_dir, split, method, kw = asked[0]
    assert shard_dir == shards and split == "train" and method == "FscClipMethod"
    assert kw["world_size"] == t["ranks"] and kw["global_batch"] == t["global_batch"]
    assert set(kw) == {"global_batch", "world_size", "num_workers", "epoch_unit", "epoch_samples", "accum_steps"}
    assert [r for r in refusals(p, "shards.maxcount") if r["stage"] == "train@fsc_clip"]
    # without shards: estimated from the sources' records, and said so (the real base profile: an epoch of
    # plain CLIP is every train2014 caption once)
    params, stages = recipe_params(tree, "")
    t = row(make(tree, params, stages, 8), "train@clip")
    assert t["coverage"] == "estimated" and t["repeated"] == 0
    assert t["units"] == t["seen"] == tree["counts"]["coco_train_captions"]


def test_with_the_shards_built_the_plan_reads_the_loaders_exact_coverage(tree):
    """The real `epoch_coverage` over shards the `shards` stage wrote (FSC-CLIP's recipe: Karpathy train + restval):
    every caption once an epoch, at 8 ranks x the recipe's workers."""
    params, stages = recipe_params(tree, "fsc_clip")
    root = tree["root"]
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    try:
        subprocess.run([sys.executable, "stages/shards.py", "--stage", "shards"], cwd=root, check=True,
                       capture_output=True, text=True)
        t = row(make(tree, params, stages, 8), "train@fsc_clip")
    finally:
        import shutil

        shutil.rmtree(root / "data" / "shards", ignore_errors=True)
    assert t["coverage"] == "exact" and t["units"] == t["seen"] > 0 and t["repeated"] == 0, t
    assert t["steps_per_epoch"] == -(-t["units"] // t["global_batch"])


def test_missing_inputs_are_refused(tree):
    params, stages = recipe_params(tree, "fsc_clip", sources={"coco": {"captions": "datasets/coco/nowhere.json"}})
    (r,) = refusals(make(tree, params, stages, 1), "sources.coco.captions")
    assert "nowhere.json" in r["message"] and r["fixes"]


def _h200_steps(arch: str = "ViT-B-16") -> dict:
    """{(method, per-rank batch): seconds per step} and the loader's samples/s per worker, from the committed
    calibration file (benchmarks/calibration.json: the acceptance run's figures)."""
    figures = json.loads((ROOT / "benchmarks" / "calibration.json").read_text())["figures"]
    steps = {(f["method"], f.get("batch", 128)): f.get("batch", 128) / f["value"] for f in figures
             if f["what"] == "train_step" and f["device"] == H200 and f["arch"] == arch}
    loader = next(f["value"] for f in figures if f["what"] == "loader" and f["device"] == H200)
    return {"steps": steps, "loader": loader}


def test_training_time_is_measured_scaled_or_unknown_and_says_from_what(tree, monkeypatch):
    params, stages = recipe_params(tree, "")                       # the real base profile: ViT-B-16, batch 256
    h200 = _h200_steps()
    workers = 6                                                    # this host's loader workers per rank
    monkeypatch.setenv("CLIPFINETUNE_WORKERS", str(workers))
    # 2 GPUs: 128 per rank, the batch the step table measured; each rank at the slower of the step and its loader
    t = row(make(tree, params, stages, 2), "train@fsc_clip")
    assert t["rank_batch"] == 128
    step = max(h200["steps"][("fsc_clip", 128)], 128 / (workers * h200["loader"]))
    assert t["seconds"] == pytest.approx(t["epochs"] * t["steps_per_epoch"] * step)
    assert t["basis"] == ("measured" if step == h200["steps"][("fsc_clip", 128)] else "scaled")
    # 8 GPUs: 32 per rank, between the latency floor's largest batch and 128: interpolated, never the linear
    # speed-up (which would make a step a quarter of the batch-128 one)
    t8 = row(make(tree, params, stages, 8), "train@fsc_clip")
    assert t8["rank_batch"] == 32 and t8["basis"] == "scaled" and "interpolated" in t8["time_source"]
    per_step = t8["seconds"] / (t8["epochs"] * t8["steps_per_epoch"])
    assert h200["steps"][("", 16)] < per_step < h200["steps"][("fsc_clip", 128)]
    assert per_step > h200["steps"][("fsc_clip", 128)] / 4
    t = row(plan.make_plan(params, tree["root"], plan.Hardware(8, 1, "NVIDIA A100"), stages=stages, timeout=2.0),
            "train@fsc_clip")
    assert t["seconds"] is None and t["basis"] == "unknown"                 # nothing measured on that card
    params["model"]["name"] = "ViT-L-14"
    t = row(make(tree, params, stages, 8), "train@fsc_clip")
    assert t["seconds"] is None                                             # nor for that architecture


def test_a_latency_bound_batch_takes_the_floor_names_the_better_layout_and_the_papers_cost(tree):
    """GOAL's 16 over 8 GPUs is 2 per rank: a step costs the measured batch-2 floor, the plan says so and names
    the two runs side by side on 4 GPUs each; the paper's own cost (about 1 h on one RTX 4090) stands beside."""
    params, stages = recipe_params(tree, "goal")
    h200 = _h200_steps()
    p = make(tree, params, stages, 8)
    t = row(p, "train@goal")
    assert t["rank_batch"] == 2 and t["latency_bound"]
    assert t["seconds"] == pytest.approx(t["epochs"] * t["steps_per_epoch"] * h200["steps"][("", 2)])
    assert t["basis"] == "scaled" and "latency floor" in t["time_source"]
    (advice,) = [w for w in p["warnings"] if "latency-bound" in w]
    assert "train@goal" in advice and "train@goal_global_only" in advice
    assert "side by side on 4 GPU(s) each" in advice and "compute.train_nproc: 4" in advice
    assert "RTX 4090" in t["paper"] and "1 h" in t["paper"]
    text = plan.render(p)
    assert "time: at least " in text and "GPU-hours at least" in text and "RTX 4090" in text
    assert p["gpu_hours"] >= t["seconds"] * len(t["gpus"]) / 3600 > 0
    assert p["timed_stages"] < p["counted_stages"]                          # eval, lism, ...: unknown, said so
    # one GPU: the same batch 16 is no longer split, no advice
    assert not [w for w in make(tree, params, stages, 1)["warnings"] if "latency-bound" in w]


def test_the_project_tools_name_no_method():
    """What the planner needs to know about a method (its prepared tables, its kind of caption, its epoch's units)
    it asks the method's hooks (methods/base.py), as the trainer does: no method's name in the tools' code, except
    a comment line or an import of a data package named after its paper."""
    import re

    from clipfinetune.registry import METHODS

    names = re.compile("|".join([m for m in METHODS if m != "clip"] + ["fsc"]), re.IGNORECASE)
    tools = sorted((ROOT / "clipfinetune" / "project").rglob("*.py"))
    assert len(tools) >= 8                                          # plan's parts, validate, profile, cli
    found = [f"{path.name}:{i}: {line.strip()}" for path in tools if path.name != "deps.py"  # moved in separately
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if names.search(line) and not line.strip().startswith("#")
             and not re.match(r"\s*from clipfinetune\.data\.[\w.]+ import", line)]
    assert found == []


def test_the_committed_sample_params_pass_on_the_cpu_through_the_command_line(tree):
    path = tree["root"] / "params.yaml"
    path.write_text(committed("params.yaml"))
    proc = subprocess.run([sys.executable, "-m", "clipfinetune.project.plan", "--params", str(path), "--gpus", "0",
                           "--json"],
                          cwd=tree["root"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["ok"] and out["hardware"]["device"] == "cpu"
    names = [r["stage"] for r in out["stages"]]
    assert names.index("shards") < names.index("train@clip") < names.index("eval@clip")   # dependencies first
    assert all(r["ranks"] == 1 for r in out["stages"])
    # a refused configuration exits 1 and says why, before anything ran
    params = yaml.safe_load(committed("params.yaml"))
    params["compute"].update(nproc=3, train_nproc=3)         # 3 gloo ranks: 64 does not split
    refused = _written(tree, "refused", params)
    proc = subprocess.run([sys.executable, "-m", "clipfinetune.project.plan", "--params", str(refused), "--gpus", "0"],
                          cwd=tree["root"], capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "REFUSED" in proc.stdout and "train.batch_size: 63" in proc.stdout


def test_dvc_repro_of_a_refused_real_configuration_stops_at_the_plan_before_any_other_stage(tree):
    """params.real.yaml lists stage plan@repro, on which every other stage depends: `dvc repro` of a configuration
    the plan refuses (GOAL without its local pairs) fails there, before any data stage, pretrain or training ran."""
    root = tree["root"]
    params, stages = recipe_params(tree, "goal", lism={"sources": []})
    assert stages[0].name == "plan@repro" and all("data/plan" in s.deps for s in stages[1:])
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    try:
        proc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, capture_output=True, text=True,
                              check=False)
    finally:
        (root / "params.yaml").write_text(committed("params.yaml"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "plan@repro" in out and "lism.sources" in out and "global-only" in out, out[-3000:]
    assert not (root / "data/plan/passed.json").exists() and not (root / "models/base").exists()
    assert not list((root / "data/prepared").glob("*.parquet")) and not (root / "data/shards").exists()


def test_calibration_figures_keep_one_per_batch_and_carry_their_schema(tmp_path):
    """benchmarks/calibration.py absorbs rows in the figure schema with a per-rank `batch` (the acceptance run's):
    a figure replaces the one of the same device, what, arch, method and batch, and keeps the other batches."""
    from benchmarks.calibration import record

    path = tmp_path / "calibration.json"
    row = {"device": "NVIDIA H200", "what": "train_step", "arch": "ViT-B-16", "method": "clip", "unit": "samples/s",
           "per": "GPU", "settings": "s", "source": "first"}
    record([{**row, "batch": 2, "value": 36.0}, {**row, "batch": 128, "value": 1602.0}], path)
    record([{**row, "batch": 2, "value": 40.0, "source": "second"}], path)
    figures = json.loads(path.read_text())["figures"]
    assert sorted((f["batch"], f["value"], f["source"]) for f in figures) == [(2, 40.0, "second"),
                                                                              (128, 1602.0, "first")]
    committed_figures = json.loads((ROOT / "benchmarks" / "calibration.json").read_text())["figures"]
    keys = {"device", "what", "arch", "method", "value", "unit", "per", "settings", "source"}
    assert all(keys <= set(f) <= keys | {"batch"} for f in committed_figures)
