"""The real-data profile (params.real.yaml), `clipfinetune.project.profile apply` and
`clipfinetune.project.validate`."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from fixtures import real_tree
from fixtures.llm import openai_server
from fixtures.profiles import unknown_keys
from fixtures.project import committed, committed_params

from clipfinetune.project import profile, validate

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "params.real.yaml"


def test_the_real_profile_only_names_keys_params_yaml_has_or_new_benchmark_sets():
    params = committed_params()
    real = yaml.safe_load(REAL.read_text())
    assert set(real) <= set(params)                       # no block shadowing the top-level keys
    assert unknown_keys(real, params) == []

def test_apply_merges_in_place_keeping_comments_and_dvc_set_param_still_works(tmp_path):
    from dvc.utils.hydra import apply_overrides

    params = tmp_path / "params.yaml"
    params.write_text(committed("params.yaml"))
    changed = profile.apply([REAL, ROOT / "recipes" / "mulclip.yaml"], params)     # the base, then a recipe
    text = params.read_text()
    assert "# the embedded sample world" in text and "# DeGLA's LLM hard negatives" in text
    merged = yaml.safe_load(text)
    assert merged["model"]["name"] == "ViT-B-16" and merged["model"]["pretrained"] == "openai"
    mulclip = merged["train"]["mulclip"]                                   # MulCLIP §4.1 "Training setting"
    assert (mulclip["epochs"], mulclip["wd"], mulclip["warmup"], mulclip["lr"]) == (8, 0.05, 200, 1e-5)
    assert mulclip["new_module_lr"] == 2e-4 and merged["train"]["lr"] == 5e-6    # the base's shared value stays
    evalsets = merged["eval"]["evalsets"]
    assert evalsets["retrieval"]["real"] == {"coco_captions": "datasets/coco/annotations/captions_val2017.json",
                                               "images": "datasets/coco/val2017"}  # MulCLIP §4.1: COCO2017 val, whole
    assert set(evalsets["retrieval"]) == {"real", "flickr1k"}            # no sample-world set on a real model
    assert evalsets["long_retrieval"]["real"]["splits"] == ["test", "qual_test"]
    assert evalsets["box_cls"] == {} and evalsets["box_cls_hard"] == {}  # a task turned off
    assert merged["sample"] == {**committed_params()["sample"], "build": []}   # the sample world left out
    assert "model.name" in changed and "runs" in changed and "pretrain.lr" not in changed   # same value: no change
    assert set(merged["runs"]) == {"mulclip", "mulclip_global_only"}       # the recipe's runs replace the list
    assert profile.apply([REAL, ROOT / "recipes" / "mulclip.yaml"], params) == []      # idempotent
    apply_overrides(str(params), ["loss.lambda_word=0.2"])                   # what `dvc exp run -S` does
    assert yaml.safe_load(params.read_text())["loss"]["lambda_word"] == 0.2


# ------------------------------------------------------------------------------------- a miniature real tree
@pytest.fixture(scope="module")
def llm_server():
    with openai_server(reply=lambda prompt: "") as (base_url, _):
        yield base_url


@pytest.fixture(scope="module")
def real_project(tmp_path_factory, llm_server):
    """A project root with dvc.yaml, the real profile applied, tiny exported weights and the miniature tree."""
    from dvc.repo import Repo

    from clipfinetune.models import export_model, load_model

    root = tmp_path_factory.mktemp("real")
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    (root / "params.yaml").write_text(committed("params.yaml"))
    Repo.init(str(root), no_scm=True)
    real_tree.build(root)
    export_model(load_model("cft-tiny-vit"), root / "weights" / "tiny")
    profile.apply(REAL, root / "params.yaml")
    with open(root / "params.yaml") as f:
        y = profile._yaml()
        params = y.load(f)
    profile.deep_merge(params, {
        "model": {"pretrained": f"local-dir:{root / 'weights' / 'tiny'}"},
        "lism": {"model": "weights/tiny", "pretrained": ""},
        "segments": {"sam_checkpoint": ""},          # segment_anything is not installed here: the CPU fallback
        "negatives": {"base_url": llm_server}})
    with open(root / "params.yaml", "w") as f:
        y.dump(params, f)
    return root


def test_the_real_profile_on_a_miniature_tree_validates_clean(real_project, capsys):
    assert validate.main(["--params", str(real_project / "params.yaml"), "--timeout", "2"]) == 0
    out = capsys.readouterr().out
    assert "0 missing" in out and "MISSING" not in out
    assert "segments.sam_checkpoint" in out                # the fallback is noted, not hidden


def test_a_missing_path_weight_or_endpoint_is_named(real_project, capsys):
    params = yaml.safe_load((real_project / "params.yaml").read_text())
    produced = validate.produced_paths(real_project)
    assert "data/prepared/sentences.parquet" in produced and "models/base" in produced
    params["sources"]["docci"]["descriptions"] = "datasets/docci/nope.jsonlines"
    params["eval"]["evalsets"]["aro"]["real"]["images"] = "datasets/aro/imgs"
    params["model"]["pretrained"] = f"local-dir:{real_project / 'weights' / 'gone'}"
    params["negatives"]["model"] = "other/model"
    params["segments"]["sam_checkpoint"] = "datasets/weights/sam_vit_h_4b8939.pth"
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=2, produced=produced) if f.missing}
    assert "nope.jsonlines" in found["sources.docci.descriptions"]
    assert "datasets/aro/imgs" in found["eval.evalsets.aro.real.images"]
    assert "gone" in found["model.pretrained"]
    assert "other/model" in found["negatives.model"]
    assert "sam_vit_h_4b8939.pth" in found["segments.sam_checkpoint"]
    params["negatives"]["base_url"] = "http://127.0.0.1:9/v1"             # nothing listens on the discard port
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=1, produced=produced) if f.missing}
    assert "GET http://127.0.0.1:9/v1/models failed" in found["negatives.base_url"]

    (real_project / "bad.yaml").write_text(yaml.safe_dump(params))
    assert validate.main(["--params", str(real_project / "bad.yaml"), "--timeout", "1"]) == 1
    assert "MISSING  sources.docci.descriptions" in capsys.readouterr().out


def test_an_open_clip_name_as_lism_model_or_a_pipeline_output_as_pretrained_is_named(real_project):
    params = yaml.safe_load((real_project / "params.yaml").read_text())
    produced = validate.produced_paths(real_project)
    params["lism"].update(model="ViT-L-14-336", pretrained="openai")     # a DVC dep of stage lism: not a path
    params["model"]["pretrained"] = "local-dir:models/base"              # pretrain's own output
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=2, produced=produced) if f.missing}
    assert "export_model(load_model('ViT-L-14-336', 'openai'), 'datasets/weights/ViT-L-14-336-openai')" \
        in found["lism.model"]
    assert "pipeline output" in found["model.pretrained"]
    params["lism"]["model"] = "datasets/weights/ViT-L-14-336-openai"     # the profile's folder, not exported here
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=2, produced=produced) if f.missing}
    assert "ViT-L-14-336-openai does not exist" in found["lism.model"]


def test_every_input_path_a_data_stage_reads_is_its_dvc_dependency(real_project):
    """With the real profile applied, a stage's input files are its deps (DVC re-runs it when they change, and
    no sample-world path remains a dep of a stage that reads a real one)."""
    from dvc.repo import Repo

    params = yaml.safe_load((real_project / "params.yaml").read_text())
    with Repo(str(real_project)) as repo:
        deps = {s.name.split("@")[0]: {d.def_path for d in s.deps} for s in repo.index.stages}   # lism@docci: lism
    for key, _ in validate.PATH_PARAMS:
        if key == "lism.ground_truth":                # measurement only, never a dep (tests/test_lism.py)
            continue
        stage, leaf = key.split(".")
        assert params[stage][leaf] in deps[stage], (key, sorted(deps[stage]))
    assert params["lism"]["model"] in deps["lism"]
    assert not any(d.startswith("data/sample") for d in deps["negatives"])
