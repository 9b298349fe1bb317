"""The embedded sample world: layout, real-format readers, boxes vs pixels, determinism, disjointness."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from pycocotools.coco import COCO
from test_sample_truth import COLOURS, SHAPES, SMALL_WORLD, colour_name, scenes, tiny_world

REPO = Path(__file__).resolve().parents[1]

LAYOUT = ["annotations/instances_train.json", "annotations/instances_val.json",
          "annotations/captions_train.json", "annotations/captions_val.json",
          "docci/descriptions.jsonlines", "docci/lism_ground_truth.jsonl",
          "karpathy/dataset_coco.json", "karpathy/coco_karpathy_test.json",
          *[f"sugarcrepe/{k}.json" for k in ["replace_obj", "replace_att", "replace_rel", "swap_obj", "swap_att",
                                              "add_obj", "add_att"]],
          "aro/visual_genome_relation.json", "aro/visual_genome_attribution.json",
          "box_cls/instances_shape.json", "box_cls/instances_shape_color.json",
          "zeroshot/shape/classnames.txt", "zeroshot/shape/templates.txt",
          "zeroshot/shape_color/classnames.txt", "zeroshot/shape_color/templates.txt", "meta.json"]


def test_layout_of_developers_md_and_params_paths_exist():
    root = tiny_world()
    for rel in LAYOUT + ["images/train", "images/val", "images/docci", "docci/images", "aro/images",
                         "zeroshot/shape/test", "zeroshot/shape_color/test"]:
        assert (root / rel).exists(), rel
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for bench in params["eval"]["evalsets"].values():
        for path in bench.get("sample", {}).values():
            if path.startswith("data/sample/"):
                assert (root / path[len("data/sample/"):]).exists(), path


def test_meta_counts_and_seed():
    meta = json.loads((tiny_world() / "meta.json").read_text())
    assert meta["seed"] == SMALL_WORLD["seed"] and meta["config"] == SMALL_WORLD
    c = meta["counts"]
    assert c["train_images"] == SMALL_WORLD["n_train"] and c["val_images"] == SMALL_WORLD["n_val"]
    assert len(list((tiny_world() / "images/train").glob("*.jpg"))) == SMALL_WORLD["n_train"]
    assert set(meta["colours"]) == set(COLOURS) and set(meta["shapes"]) == set(SHAPES)


@pytest.mark.parametrize("split", ["train", "val"])
def test_coco_instances_read_by_pycocotools(split):
    root = tiny_world()
    coco = COCO(str(root / f"annotations/instances_{split}.json"))
    recs = scenes(root)
    assert {c["name"] for c in coco.loadCats(coco.getCatIds())} == set(SHAPES)
    assert all(c["supercategory"] for c in coco.dataset["categories"])
    for img in coco.dataset["images"]:
        rec = recs[f"images/{split}/{img['file_name']}"]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[img["id"]]))
        assert 2 <= len(anns) == len(rec["objects"]) <= 4
        assert sorted(coco.cats[a["category_id"]]["name"] for a in anns) == sorted(o["shape"] for o in rec["objects"])
        for a in anns:
            x, y, w, h = a["bbox"]
            assert a["iscrowd"] == 0 and isinstance(a["segmentation"], list) and w > 2 and h > 2
            assert 0 <= x and 0 <= y and x + w <= img["width"] and y + h <= img["height"]
            mask = coco.annToMask(a)
            ys, xs = np.nonzero(mask)
            assert abs(mask.sum() - a["area"]) <= 1
            assert xs.min() >= x - 1 and xs.max() <= x + w and ys.min() >= y - 1 and ys.max() <= y + h


def test_boxes_and_masks_match_the_drawn_objects():
    """Pixels under each mask have the object's colour (read by hue, not by the generator's palette), and pixels
    of that colour lie inside the boxes of objects of that colour."""
    root = tiny_world()
    coco = COCO(str(root / "annotations/instances_val.json"))
    recs = scenes(root)
    for img in coco.dataset["images"]:
        pix = np.asarray(Image.open(root / "images/val" / img["file_name"]).convert("RGB"), dtype=np.float32)
        objs = recs[f"images/val/{img['file_name']}"]["objects"]
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[img["id"]]))
        for a in anns:
            o = next(o for o in objs if np.allclose(o["bbox"], [a["bbox"][0], a["bbox"][1],
                                                               a["bbox"][0] + a["bbox"][2],
                                                               a["bbox"][1] + a["bbox"][3]]))
            mask = coco.annToMask(a).astype(bool)
            inner = pix[mask][np.argsort(pix[mask].sum(1))[len(pix[mask]) // 2:]]   # drop blended edge pixels
            assert colour_name(np.median(inner, 0)) == o["colour"], (img["file_name"], o)
            near = np.linalg.norm(pix - np.array(o["rgb"], np.float32), axis=-1) < 40
            inside = np.zeros(near.shape, bool)
            for p in objs:
                if p["colour"] == o["colour"]:
                    x0, y0, x1, y1 = p["bbox"]
                    inside[int(y0):int(np.ceil(y1)) + 1, int(x0):int(np.ceil(x1)) + 1] = True
            assert (near & ~inside).sum() <= 3, (img["file_name"], o)
            assert (near & mask).sum() >= 0.5 * mask.sum(), (img["file_name"], o)


def test_captions_read_by_pycocotools_five_per_image():
    root = tiny_world()
    for split in ("train", "val"):
        caps = COCO(str(root / f"annotations/captions_{split}.json"))
        inst = COCO(str(root / f"annotations/instances_{split}.json"))
        assert set(caps.imgs) == set(inst.imgs)
        for iid in caps.imgs:
            texts = [a["caption"] for a in caps.loadAnns(caps.getAnnIds(imgIds=[iid]))]
            assert len(texts) == 5 and len(set(texts)) >= 4 and all(t.endswith(".") for t in texts)


def test_karpathy_formats():
    root = tiny_world()
    kp = json.loads((root / "karpathy/dataset_coco.json").read_text())
    assert kp["dataset"] == "coco"
    val_ids = set(COCO(str(root / "annotations/instances_val.json")).imgs)
    test = [im for im in kp["images"] if im["split"] == "test"]
    assert {im["cocoid"] for im in test} == val_ids
    keys = {"filepath", "filename", "imgid", "split", "sentences", "sentids", "cocoid"}
    sentids = []
    for i, im in enumerate(kp["images"]):
        assert set(im) == keys and im["imgid"] == i and (root / "images" / im["filepath"] / im["filename"]).exists()
        assert [s["sentid"] for s in im["sentences"]] == im["sentids"] and len(im["sentences"]) == 5
        for s in im["sentences"]:
            assert set(s) == {"raw", "tokens", "imgid", "sentid"} and s["imgid"] == i
            assert s["tokens"] and all(t == t.lower() and t.isalnum() for t in s["tokens"])
        sentids += im["sentids"]
    assert len(sentids) == len(set(sentids))
    blip = json.loads((root / "karpathy/coco_karpathy_test.json").read_text())
    assert len(blip) == len(test)
    for rec, im in zip(blip, test):
        assert set(rec) == {"image", "caption"} and rec["caption"] == [s["raw"] for s in im["sentences"]]
        assert (root / "images" / rec["image"]).exists()


def test_box_classification_sets():
    root = tiny_world()
    recs = scenes(root)
    shape = COCO(str(root / "box_cls/instances_shape.json"))
    hard = COCO(str(root / "box_cls/instances_shape_color.json"))
    assert {c["name"] for c in shape.dataset["categories"]} == set(SHAPES)
    assert len(hard.dataset["categories"]) == len(SHAPES) * len(COLOURS)
    for img in hard.dataset["images"]:
        objs = recs[f"images/val/{img['file_name']}"]["objects"]
        names = sorted(hard.cats[a["category_id"]]["name"] for a in hard.loadAnns(hard.getAnnIds(imgIds=[img["id"]])))
        assert names == sorted(f"{o['colour']} {o['shape']}" for o in objs)


@pytest.mark.parametrize("task", ["shape", "shape_color"])
def test_zeroshot_imagefolders(task):
    root = tiny_world() / "zeroshot" / task
    recs = scenes(tiny_world())
    folders = sorted(p.name for p in (root / "test").iterdir())
    names = root.joinpath("classnames.txt").read_text().splitlines()
    assert len(names) == len(folders) == (8 if task == "shape" else 64)
    assert [n.replace(" ", "_") for n in names] == folders            # ImageFolder index i <-> line i
    templates = root.joinpath("templates.txt").read_text().splitlines()
    assert len(templates) >= 3 and all("{}" in t for t in templates)
    for folder, name in zip(folders, names):
        files = sorted((root / "test" / folder).glob("*.jpg"))
        assert len(files) == SMALL_WORLD["n_zeroshot_per_class"]
        for f in files:
            (o,) = recs[str(f.relative_to(tiny_world()))]["objects"]
            assert o["shape"] == name.split()[-1] and (task == "shape" or o["colour"] == name.split()[0])


def _md5s(paths):
    return {hashlib.md5(p.read_bytes()).hexdigest() for p in paths}


def test_evaluation_images_disjoint_from_training_images():
    root = tiny_world()
    docci = [json.loads(x) for x in (root / "docci/descriptions.jsonlines").read_text().splitlines()]
    train = list((root / "images/train").glob("*.jpg")) + list((root / "images/pretrain").glob("*.jpg")) + \
        [root / "docci/images" / d["image_file"] for d in docci if d["split"] == "train"]
    evals = list((root / "images/val").glob("*.jpg")) + list((root / "aro/images").glob("*.jpg")) + \
        list((root / "zeroshot").rglob("*.jpg")) + \
        [root / "docci/images" / d["image_file"] for d in docci if d["split"] == "test"]
    assert not {p.name for p in train} & {p.name for p in evals}
    assert not _md5s(train) & _md5s(evals)
    train_ids = set(COCO(str(root / "annotations/instances_train.json")).imgs)
    assert not train_ids & set(COCO(str(root / "annotations/instances_val.json")).imgs)


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_pretraining_split_labels_groups_and_captions_match_its_scenes():
    """Each pretraining image: 1-2 objects; `colour` = its first object's colour, `labels` = [shape, colour] of a
    one-object image (else empty); every caption names only what the scene holds, and the kinds that list every object
    (with or without colours) name all of it; shapes-only captions exist (colour alone cannot match them)."""
    root = tiny_world()
    coco = json.loads((root / "annotations/captions_pretrain.json").read_text())
    assert (len(coco["images"]) == SMALL_WORLD["n_pretrain"]
            and not (root / "annotations/instances_pretrain.json").exists())
    recs = scenes(root)
    captions: dict = {}
    for a in coco["annotations"]:
        captions.setdefault(a["image_id"], []).append(a["caption"].lower())
    shapes_only = 0
    for image in coco["images"]:
        objects = recs[f"images/pretrain/{image['file_name']}"]["objects"]
        assert 1 <= len(objects) <= 2 and image["colour"] == objects[0]["colour"]
        assert image["labels"] == ([objects[0]["shape"], objects[0]["colour"]] if len(objects) == 1 else [])
        assert [(r["box"], r["labels"], r["text"].split()[-2:]) for r in image["regions"]] == \
            [(o["bbox"], [o["shape"], o["colour"]], [o["colour"], o["shape"]]) for o in objects]
        assert len(captions[image["id"]]) == 5
        for text in captions[image["id"]]:
            words = set(text.replace(".", " ").replace(",", " ").split())
            named_shapes = {s for s in SHAPES if s in words or s + "s" in words}
            named_colours = {c for c in COLOURS if c in words}
            assert named_shapes <= {o["shape"] for o in objects} and named_colours <= {o["colour"] for o in objects}
            shapes_only += not named_colours and named_shapes == {o["shape"] for o in objects}
    assert shapes_only >= 0.1 * 5 * SMALL_WORLD["n_pretrain"]


def test_pretraining_close_ups_hold_one_large_object_inside_the_image():
    import numpy as np

    from clipfinetune.sample.world import _closeup

    for i in range(200):
        o = _closeup(np.random.default_rng([7, i]), 64)
        x0, y0, x1, y1 = o.bbox
        assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64, (i, o.bbox)
        assert max(x1 - x0, y1 - y0) >= 32 and o.size == "large"     # larger than any scene object (<= 35 px)


def test_same_seed_byte_identical_and_other_seed_differs(tmp_path):
    from clipfinetune.sample.world import WorldConfig, generate_world

    small = {"image_size": 64, "n_train": 6, "n_val": 6, "n_docci_train": 4, "n_docci_test": 4,
             "n_compositional": 6, "n_zeroshot_per_class": 1, "n_pretrain": 4}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        generate_world(tmp_path / name, WorldConfig(seed=seed, **small))
    a, b, c = (_tree(tmp_path / n) for n in "abc")
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    assert c.keys() == a.keys()
    differing = [k for k in a if a[k] != c[k]]
    assert "annotations/captions_train.json" in differing and len(differing) > 0.9 * len(a)


def test_stage_reads_exactly_the_declared_sample_params():
    from fixtures.project import committed_params

    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stage = dvc["stages"]["sample"]
    assert stage["foreach"] == "${sample.build}"         # sample@world; `build: []` leaves it out of the DAG
    declared = {p[len("sample."):] for p in stage["do"]["params"]}
    params = committed_params()["sample"]
    from clipfinetune.sample.world import WorldConfig

    assert params["build"] == ["world"]
    assert declared == set(params) - {"build"} == set(WorldConfig.__dataclass_fields__)


def test_scene_records_read_back_as_the_scenes_written():
    from clipfinetune.sample.scene import Scene

    for rec in scenes(tiny_world()).values():
        scene = Scene.from_record(rec)
        assert len(scene.objects) == len(rec["objects"]) > 0
        assert [(o.colour, o.shape, list(o.rgb), o.bbox) for o in scene.objects] == \
            [(o["colour"], o["shape"], o["rgb"], o["bbox"]) for o in rec["objects"]]
        assert {"image": rec["image"], "split": rec["split"], **scene.record()} == rec
