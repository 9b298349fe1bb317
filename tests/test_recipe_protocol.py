"""Each paper recipe against the paper's own protocol, kept here as a table typed from the papers (issue #36):
the evaluation sets it scores (which files, which split, the size the paper states), and how it trains
(precision, sentence splitter, epoch size, transform). A recipe edit that drifts from its paper fails here; the
sets are read on the miniature real tree with the evaluator's own readers."""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from pathlib import Path

import pytest
from fixtures import real_tree
from fixtures.project import committed_params

from clipfinetune.data.evalsets.sets import read_set
from clipfinetune.project import profile
from clipfinetune.train import TrainConfig, merge_train_settings

ROOT = Path(__file__).resolve().parents[1]
DOCCI = {"docci": "datasets/docci/docci_descriptions.jsonlines", "images": "datasets/docci/images"}
DOCCI_TEST = {**DOCCI, "splits": ["test", "qual_test"]}              # 5,000 test + 100 qual_test
GOAL_DCI = {"goal_list": "datasets/dci/DCI_test.json", "images": "datasets/dci/photos"}   # 1,999 of DCI's train
URBAN = {"urban1k": "datasets/Urban1k"}
KARPATHY_5K = {"karpathy": "datasets/karpathy/dataset_coco.json", "images": "datasets/coco"}
COCO_VAL2017 = {"coco_captions": "datasets/coco/annotations/captions_val2017.json", "images": "datasets/coco/val2017"}
FLICKR_1K = {"karpathy": "datasets/karpathy/dataset_flickr30k.json", "images": "datasets/flickr30k/flickr30k-images"}
PANOPTIC = {"panoptic": "datasets/coco/annotations/panoptic_val2017.json", "images": "datasets/coco/val2017"}
SUGARCREPE = {"dir": "datasets/sugarcrepe", "images": "datasets/coco/val2017"}
ARO = {"dir": "datasets/aro", "images": "datasets/aro/images", "coco_order": "datasets/aro/coco_karpathy_test.json",
       "coco_order_images": "datasets/coco"}
VALSE = {"dir": "datasets/VALSE/data"}
WINOGROUND = {"dir": "datasets/winoground"}
GLOBAL_LOCAL = {"test_list": "data/evalsets/global_local/test.json", "images": "data/evalsets/global_local"}


def zeroshot(*names):
    return {f"zeroshot.{n}": {"dir": f"datasets/zeroshot/{n}"} for n in names}


# sizes as the papers state them (the miniature tree is smaller): checked against the recipe's comments
PROTOCOL = {
    "goal": {   # GOAL (CVPR 2025) sec. 4, Tables 1, 3, 5, 9, 10, 12, 13
        "sets": {"long_retrieval.real": (DOCCI_TEST, "5,100"), "long_retrieval.dci": (GOAL_DCI, "1,999"),
                 "long_retrieval.urban1k": (URBAN, None), "retrieval.real": (COCO_VAL2017, "33.95"),   # Table 9
                 "retrieval.flickr1k": (FLICKR_1K, None), "global_local.real": (GLOBAL_LOCAL, None),
                 **{k: (v, None) for k, v in zeroshot("cifar10", "cifar100", "imagenet-o").items()}},
        "precision": "bf16", "splitter": "period", "epochs": 10, "batch_size": 16, "epoch_samples": 0,
        "train_transform": "squash"},
    "mulclip": {   # MulCLIP sec. 4.1, Tables 2-4, App. I Table 9, App. VI
        "sets": {"long_retrieval.real": (DOCCI_TEST, "5,100"), "long_retrieval.dci": (GOAL_DCI, None),
                 "long_retrieval.urban1k": (URBAN, None), "retrieval.real": (COCO_VAL2017, None),
                 "retrieval.flickr1k": (FLICKR_1K, None),
                 **{k: (v, None) for k, v in zeroshot("cifar10", "cifar100", "imagenet-o", "imagenetv2").items()}},
        "precision": "bf16", "splitter": "punctuation", "max_sentences": 15, "epochs": 8, "batch_size": 16,
        "epoch_samples": 0, "train_transform": "squash"},
    "harmoclip": {   # HarmoCLIP sec. 5.1, 5.3 (FineCLIP's box protocol), supp. sec. 7
        "sets": {"retrieval.real": (COCO_VAL2017, None), "retrieval.flickr1k": (FLICKR_1K, None),
                 "box_cls.real": (PANOPTIC, "133")},
        "precision": "fp16", "splitter": "spacy", "epochs": 5, "batch_size": 50, "epoch_samples": 0,
        "train_transform": "squash", "synonyms": "none"},
    "fsc_clip": {   # FSC-CLIP (EMNLP 2024) sec. 4, App. A.3, B
        "sets": {"retrieval.real": (KARPATHY_5K, None), "retrieval.flickr1k": (FLICKR_1K, None),
                 "sugarcrepe.real": (SUGARCREPE, None), "aro.real": (ARO, None), "valse.real": (VALSE, None),
                 "winoground.real": (WINOGROUND, None),
                 **{k: (v, None) for k, v in zeroshot(
                     "imagenet1k", "caltech101", "cifar10", "cifar100", "country211", "dtd", "eurosat", "fer2013",
                     "fgvc_aircraft", "food101", "gtsrb", "hateful_memes", "kitti_distance", "mnist", "flowers",
                     "pets", "patch_camelyon", "rendered_sst2", "resisc45", "cars", "voc2007").items()}},
        "precision": "fp16", "splitter": "spacy", "epochs": 5, "batch_size": 256, "epoch_samples": 100_000,
        "train_transform": "random_resized_crop"},
    "degla": {   # DeGLA (ACM MM 2025) sec. 4.1, Tables 2-5, 8
        "sets": {"retrieval.real": (KARPATHY_5K, None), "retrieval.flickr1k": (FLICKR_1K, None),
                 "sugarcrepe.real": (SUGARCREPE, None), "valse.real": (VALSE, None),
                 "aro.real": ({**ARO, "flickr_order": "datasets/aro/flickr30k_test.json",
                               "flickr_order_images": "datasets/flickr30k/flickr30k-images"}, None),
                 **{k: (v, None) for k, v in zeroshot(
                     "cifar10", "cifar100", "food101", "pets", "flowers", "sun397", "cars", "dtd", "caltech101",
                     "fgvc_aircraft", "imagenet1k").items()}},
        "precision": "fp16", "splitter": "spacy", "epochs": 5, "batch_size": 256, "epoch_samples": 0,
        "train_transform": "random_resized_crop"},
}
FSC_STEPS = 5 * math.ceil(100_000 / 256)            # FSC-CLIP: 1,955 optimiser steps (not ~10.7K over 0.55M captions)


def recipe_params(recipe: str, with_defaults: bool = True) -> dict:
    """The recipe with the real base (over the committed params.yaml: `with_defaults`), as `clipfinetune recipe`."""
    files = [ROOT / "params.real.yaml", ROOT / "recipes" / f"{recipe}.yaml"]
    return profile.layered(committed_params() if with_defaults else {}, *(profile.load_plain(f) for f in files))


def configured_sets(params: dict) -> dict[str, dict]:
    """{"<task>.<set>": the set's non-empty keys} of every set the profile turns on."""
    out = {}
    for task, sets in (params["eval"]["evalsets"] or {}).items():
        for name, cfg in (sets or {}).items():
            kept = {k: v for k, v in (cfg or {}).items() if v not in ("", None, {})}
            if kept:
                out[f"{task}.{name}"] = kept
    return out


@pytest.mark.parametrize("recipe", PROTOCOL)
def test_a_recipe_scores_exactly_its_papers_evaluation_sets(recipe):
    """As `clipfinetune recipe` writes it, over the committed params.yaml: every set of the paper on, and nothing
    else (no sample-world set)."""
    sets = configured_sets(recipe_params(recipe))
    want = PROTOCOL[recipe]["sets"]
    assert sorted(sets) == sorted(want)
    text = (ROOT / "recipes" / f"{recipe}.yaml").read_text() + (ROOT / "params.real.yaml").read_text()
    for name, (cfg, size) in want.items():
        got = {k: v for k, v in sets[name].items() if not (name.startswith("valse") and k == "images")}
        assert got == cfg, name
        if size:
            assert size in text, f"{recipe}: {name} should cite the paper's size {size}"


@pytest.mark.parametrize("recipe", PROTOCOL)
def test_a_recipe_trains_as_its_paper(recipe):
    p, want = recipe_params(recipe), PROTOCOL[recipe]
    train = dict(p["train"])
    override = train.pop(recipe)
    train.pop("keep_checkpoint", None)                  # the stage's own key, not the optimiser's (stages/train.py)
    shared = {k: v for k, v in train.items() if not isinstance(v, dict)}
    settings, _ = merge_train_settings(shared, override, frozenset({"new_module_lr"}))
    cfg = TrainConfig(**settings, precision=p["model"]["precision"])
    assert (cfg.precision, cfg.epochs, cfg.batch_size, cfg.epoch_samples, cfg.train_transform) == \
        (want["precision"], want["epochs"], want["batch_size"], want["epoch_samples"], want["train_transform"])
    assert cfg.epoch_unit == "method"                                   # each paper's own epoch unit
    assert p["sentences"]["splitter"] == want["splitter"]
    if "max_sentences" in want:
        assert p["sentences"]["max_sentences"] == want["max_sentences"]
    if "synonyms" in want:
        assert p["word_regions"]["synonyms"] == want["synonyms"]      # supp. sec. 7: category labels only
    if recipe == "fsc_clip":
        assert cfg.epochs * math.ceil(cfg.epoch_samples / cfg.batch_size) == FSC_STEPS == 1955


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("protocol")
    real_tree.build(root)
    return root


@pytest.mark.parametrize("recipe", PROTOCOL)
def test_a_recipes_sets_read_on_the_miniature_real_tree(recipe, tree):
    """Each set through the evaluator's reader (the one its keys select), on the real layouts."""
    sets = configured_sets(recipe_params(recipe, with_defaults=False))
    with contextlib.chdir(tree):
        for name, cfg in sets.items():
            if name == "global_local.real":              # built by the `lism` stage, not a download
                continue
            task, set_name = name.split(".", 1)
            got = read_set(task, dict(cfg), set_name)
            assert got.images, name
            if name == "long_retrieval.dci":             # GOAL's list: drawn from DCI's train split
                assert [Path(p).name for p in got.images] == ["sa_1000003.jpg"]
            if name == "box_cls.real":                   # panoptic: things and stuff in one label space
                assert "tree-merged" in got.data.classnames and len(got.data.classnames) == 6
            if name == "retrieval.real" and "coco_captions" in cfg:
                assert {Path(p).parent.name for p in got.images} == {"val2017"}


def test_random_resized_crop_is_open_clips_training_transform():
    import torch
    from PIL import Image
    from torchvision.transforms import RandomResizedCrop

    from clipfinetune.models import load_model

    model = load_model("cft-tiny-vit")
    t = model.train_transform()
    crop = next(op for op in t.transforms if isinstance(op, RandomResizedCrop))
    assert crop.scale == (0.9, 1.0) and tuple(crop.size) == tuple(model.preprocess_cfg["size"])
    image = Image.effect_noise((80, 80), 60).convert("RGB")
    torch.manual_seed(0)
    a, b = t(image), t(image)
    assert a.shape == model.transform(image).shape and not torch.equal(a, b)     # random, at the model's size
    with pytest.raises(ValueError, match="train_transform"):
        TrainConfig(epochs=1, batch_size=1, lr=1.0, train_transform="flip")


def test_the_report_sets_the_ablation_and_recall_at_k_rows_beside_ours():
    """paper_numbers.yaml's GOAL ablation row (Table 1 "Global fine-tuning") and R@5 rows reach the report's table."""
    import yaml

    from clipfinetune.report import summary as report

    numbers = yaml.safe_load((ROOT / "recipes" / "paper_numbers.yaml").read_text())
    models = {"goal_global_only": {"long_retrieval": {"real": {"t2i_r1": 70.0, "t2i_r50": 99.76}}},
              "goal": {"retrieval": {"flickr1k": {"t2i_r5": 90.3}}}, "base": None}
    rows = {(r["model"], r["metric"]): r for r in report.paper_rows(numbers["goal"], models)["rows"]}
    r = rows[("goal_global_only", "long_retrieval.real.t2i_r1")]
    assert (r["paper"], r["ours"]) == (72.41, 70.0) and r["gap"] == pytest.approx(70.0 - 72.41)
    assert rows[("goal_global_only", "long_retrieval.real.t2i_r50")]["gap"] == pytest.approx(0.0)
    assert rows[("goal", "retrieval.flickr1k.t2i_r5")]["gap"] == pytest.approx(90.3 - 89.30)
    assert rows[("goal_global_only", "global_local.real.i2t_map10")]["ours"] is None     # not evaluated: shown as –
    assert ("mulclip_global_only", "long_retrieval.dci.t2i_r1") in \
        {(r["model"], r["metric"]) for r in report.paper_rows(numbers["mulclip"], {})["rows"]}
    md = "\n".join(" | ".join(row) for row in report.paper_table(report.paper_rows(numbers["goal"], models)))
    assert "goal_global_only | long_retrieval.real.t2i_r1 | 72.4 | 70.0 | -2.4 | Table 1" in md


def test_a_valse_piece_excludes_its_coco_images_from_a_karpathy_corpus(tmp_path):
    """FSC-CLIP trains on Karpathy restval (val2014) and scores VALSE FOIL-it (val2014 images): the recipe's
    `exclude` names foil-it.json, whose COCO-named image files leave the corpus."""
    import json

    from clipfinetune.data.readers import karpathy

    sents = [{"raw": "a dog"}]
    (tmp_path / "k.json").write_text(json.dumps({"images": [
        {"cocoid": c, "filepath": "val2014", "filename": f"COCO_val2014_{c:012d}.jpg", "split": "restval",
         "sentences": sents} for c in (73, 74, 139)]}))
    (tmp_path / "foil-it.json").write_text(json.dumps({
        "foil-it:0": {"image_file": "COCO_val2014_000000000074.jpg", "caption": "a dog", "foil": "a cat"},
        "foil-it:1": {"image_file": "COCO_val2014_000000000139.jpg", "caption": "a cup", "foil": "a bowl"}}))
    counts = Counter()
    recs = karpathy.read(tmp_path / "k.json", exclude=[str(tmp_path / "foil-it.json")], counts=counts)
    assert [r.image_id for r in recs] == ["73"] and counts["karpathy_excluded"] == 2
    fsc = recipe_params("fsc_clip", with_defaults=False)["sources"]["coco_karpathy"]["exclude"]
    assert "datasets/VALSE/data/foil-it.json" in fsc and fsc[0].endswith("instances_val2017.json")
