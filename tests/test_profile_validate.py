"""The real-data profile (params.real.yaml), `clipfinetune.profile apply` and `clipfinetune.validate`."""
from __future__ import annotations

import http.server
import json
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from PIL import Image

from clipfinetune import profile, validate

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "params.real.yaml"
LLM = "meta-llama/Llama-3.1-8B-Instruct"


def test_the_real_profile_only_names_keys_params_yaml_has_or_new_benchmark_sets():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    real = yaml.safe_load(REAL.read_text())
    assert set(real) <= set(params)                       # no block shadowing the top-level keys
    for key, _ in profile.flatten(real):
        parts = key.split(".")
        if parts[:2] == ["eval", "benchmarks"] and len(parts) > 3:
            assert parts[2] in params["eval"]["benchmarks"], key      # a new set of a known benchmark
            continue
        if parts[0] == "train" and len(parts) == 3:
            continue                                      # a method's override, checked by the train stage
        node = params
        for p in parts:
            assert isinstance(node, dict) and p in node, key
            node = node[p]


def test_apply_merges_in_place_keeping_comments_and_dvc_set_param_still_works(tmp_path):
    from dvc.utils.hydra import apply_overrides

    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    changed = profile.apply(REAL, params)
    text = params.read_text()
    assert "# the embedded sample world" in text and "# FSC-CLIP (eq. 11)" in text
    merged = yaml.safe_load(text)
    assert merged["model"]["name"] == "ViT-B-16" and merged["model"]["pretrained"] == "openai"
    assert merged["train"]["goal"]["wd"] == 0.05 and merged["train"]["mulclip"]["new_module_lr"] == 2e-4
    assert merged["eval"]["benchmarks"]["retrieval"]["real"]["karpathy"].endswith("dataset_coco.json")
    assert merged["eval"]["benchmarks"]["retrieval"]["sample"]             # the sample sets are kept
    assert merged["sample"] == yaml.safe_load((ROOT / "params.yaml").read_text())["sample"]
    assert "model.name" in changed and "loss.lambda_l" not in changed       # same value: not a change
    assert profile.apply(REAL, params) == []                                # idempotent
    apply_overrides(str(params), ["loss.lambda_l=0.2"])                      # what `dvc exp run -S` does
    assert yaml.safe_load(params.read_text())["loss"]["lambda_l"] == 0.2


def test_set_args_lists_every_leaf_as_an_override():
    args = profile.set_args(REAL)
    pairs = dict(a.split("=", 1) for a in args[1::2])
    assert set(args[0::2]) == {"-S"}
    assert pairs["model.name"] == "ViT-B-16" and pairs["train.goal.wd"] == "0.05"
    assert pairs["lism.ground_truth"] == '""'


# ------------------------------------------------------------------------------------- a miniature real tree
def _img(path: Path, size=(32, 24)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (120, 30, 200)).save(path)


def _json(path: Path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def _miniature(root: Path) -> None:
    d = root / "datasets"
    images = [{"id": 1, "file_name": "000000000001.jpg", "width": 32, "height": 24}]
    cats = [{"id": 1, "name": "dog", "supercategory": "animal"}]
    for split in ("train2017", "val2017"):
        _img(d / "coco" / split / "000000000001.jpg")
    _json(d / "coco/annotations/instances_train2017.json", {"images": images, "categories": cats, "annotations": [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10], "area": 100, "iscrowd": 0}]})
    _json(d / "coco/annotations/captions_train2017.json", {"images": images, "annotations": [
        {"id": 1, "image_id": 1, "caption": "a dog on grass"}]})
    _json(d / "coco/annotations/instances_val2017_ovcoco.json", {"images": images, "categories": cats,
                                                                "annotations": [{"id": 1, "image_id": 1, "category_id": 1,
                                                                                 "bbox": [2, 2, 10, 10], "area": 100,
                                                                                 "iscrowd": 0}]})
    _img(d / "docci/images/train_00001.jpg")
    (d / "docci/docci_descriptions.jsonlines").write_text(json.dumps(
        {"example_id": "train_00001", "split": "train", "image_file": "train_00001.jpg",
         "description": "A dog. It sits on grass."}) + "\n")
    _img(d / "coco/val2014/COCO_val2014_000000000001.jpg")
    _json(d / "karpathy/dataset_coco.json", {"images": [{"filepath": "val2014", "filename":
                                                         "COCO_val2014_000000000001.jpg", "split": "test",
                                                         "sentences": [{"raw": "a dog"}]}]})
    _img(d / "flickr30k/flickr30k-images/1.jpg")
    _json(d / "karpathy/dataset_flickr30k.json", {"images": [{"filename": "1.jpg", "split": "test",
                                                              "sentences": [{"raw": "a dog"}]}]})
    (d / "dci").mkdir(parents=True)
    (d / "Urban1k/image").mkdir(parents=True)
    (d / "Urban1k/caption").mkdir(parents=True)
    _json(d / "sugarcrepe/replace_obj.json", {"0": {"filename": "000000000001.jpg", "caption": "a dog",
                                                    "negative_caption": "a cat"}})
    _json(d / "aro/visual_genome_relation.json", [])
    (d / "aro/images").mkdir(parents=True)
    _json(d / "aro/coco_karpathy_test.json", [{"image": "val2014/COCO_val2014_000000000001.jpg",
                                               "caption": ["a dog"]}])
    (d / "weights").mkdir(parents=True)


@pytest.fixture(scope="module")
def llm_server():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": LLM, "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def real_project(tmp_path_factory, llm_server):
    """A project root with dvc.yaml, the real profile applied, tiny exported weights and the miniature tree."""
    from dvc.repo import Repo

    from clipfinetune.models import export_model, load_model

    root = tmp_path_factory.mktemp("real")
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    Repo.init(str(root), no_scm=True)
    _miniature(root)
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
    params["sentences"]["docci"] = "datasets/docci/nope.jsonlines"
    params["eval"]["benchmarks"]["aro"]["real"]["images"] = "datasets/aro/imgs"
    params["model"]["pretrained"] = f"local-dir:{real_project / 'weights' / 'gone'}"
    params["negatives"]["model"] = "other/model"
    params["segments"]["sam_checkpoint"] = "datasets/weights/sam_vit_h_4b8939.pth"
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=2, produced=produced) if f.missing}
    assert "nope.jsonlines" in found["sentences.docci"]
    assert "datasets/aro/imgs" in found["eval.benchmarks.aro.real.images"]
    assert "gone" in found["model.pretrained"]
    assert "other/model" in found["negatives.model"]
    assert "sam_vit_h_4b8939.pth" in found["segments.sam_checkpoint"]
    params["negatives"]["base_url"] = "http://127.0.0.1:9/v1"             # nothing listens on the discard port
    found = {f.key: f.message for f in validate.check(params, real_project, timeout=1, produced=produced) if f.missing}
    assert "GET http://127.0.0.1:9/v1/models failed" in found["negatives.base_url"]

    (real_project / "bad.yaml").write_text(yaml.safe_dump(params))
    assert validate.main(["--params", str(real_project / "bad.yaml"), "--timeout", "1"]) == 1
    assert "MISSING  sentences.docci" in capsys.readouterr().out
