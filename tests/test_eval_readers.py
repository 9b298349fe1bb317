"""Readers of the real formats (docs/evalsets.md §8 fixtures) and the ARO / VALSE filters, hand-computed."""
import json
from pathlib import Path

import numpy as np
import pytest
from fixtures.eval import world
from fixtures.eval.fakes import FakeModel, write_image
from PIL import Image

from clipfinetune.data.evalsets import box_cls as box_sets
from clipfinetune.data.evalsets import compositionality as comp_sets
from clipfinetune.data.evalsets import long_retrieval as long_sets
from clipfinetune.data.evalsets import retrieval as retrieval_sets
from clipfinetune.data.evalsets import zeroshot as zeroshot_sets
from clipfinetune.eval import aro_order, box_cls, suite, zeroshot
from clipfinetune.eval import compositionality as comp
from clipfinetune.eval.encode import Encoder
from clipfinetune.io import InputError


def test_flickr_txt_keeps_commas_and_groups_by_first_appearance(tmp_path):
    write_image(tmp_path / "1000.jpg", 1)
    write_image(tmp_path / "2000.jpg", 2)
    f = tmp_path / "flickr30k_test_karpathy.txt"
    f.write_text("image,caption\n2000.jpg,A dog.\n1000.jpg,Someone cycling, fast.\n2000.jpg,A dog, running.\n")
    d = retrieval_sets.read_flickr_txt(f, tmp_path)
    assert [p.split("/")[-1] for p in d.images] == ["2000.jpg", "1000.jpg"]
    assert d.captions == ["A dog.", "A dog, running.", "Someone cycling, fast."]
    assert d.caption_image == [0, 0, 1]


def test_flickr_token_and_blip_list(tmp_path):
    write_image(tmp_path / "flickr30k-images" / "1000.jpg", 1)
    tok = tmp_path / "results.token"
    tok.write_text("1000.jpg#0\tA man rides a bike .\n1000.jpg#1\tSomeone cycling .\n")
    d = retrieval_sets.read_flickr_token(tok, tmp_path / "flickr30k-images")
    assert d.captions == ["A man rides a bike .", "Someone cycling ."] and d.caption_image == [0, 0]
    blip = tmp_path / "flickr30k_test.json"
    blip.write_text(json.dumps([{"image": "flickr30k-images/1000.jpg", "caption": ["a", "b", "c"]}]))
    assert retrieval_sets.read_blip_list(blip, tmp_path).caption_image == [0, 0, 0]


def test_karpathy_reads_only_the_test_split(tmp_path):
    cfg = world.build(tmp_path)["retrieval"]["sample"]
    d = retrieval_sets.load_retrieval_set(cfg)
    assert [p.split("/")[-1] for p in d.images] == ["1.png", "2.png", "3.png"]
    assert d.captions[:2] == ["A photo id1 of a thing.", "Another view id1 of it."]


def test_docci_split_filter_excludes_train_and_qual_test(tmp_path):
    cfg = world.build(tmp_path)["long_retrieval"]["sample"]
    d = long_sets.load_long_set(cfg)
    assert [p.split("/")[-1] for p in d.images] == ["test_00000.png", "test_00001.png"]


def test_dci_extra_caption_and_complete_description(tmp_path):
    rec = {"image": "sa_1.jpg", "short_caption": "A blue door.", "extra_caption": "It has a knob.",
           "mask_keys": ["0", "1", "2"],
           "mask_data": {"0": {"mask_quality": 0, "label": "door", "caption": "A blue wooden door."},
                         "1": {"mask_quality": 1, "label": "knob"},
                         "2": {"mask_quality": 2}}}
    (tmp_path / "complete").mkdir()
    (tmp_path / "complete" / "sa_1.json").write_text(json.dumps(rec))
    (tmp_path / "splits.json").write_text(json.dumps({"train": [], "valid": [], "test": ["sa_1.json"]}))
    write_image(tmp_path / "photos" / "sa_1.jpg", 1)
    assert long_sets.read_dci(tmp_path).captions == ["It has a knob."]
    full = long_sets.read_dci(tmp_path, field="complete").captions[0]
    assert full == ("A blue door.\nIt has a knob.\nThe following can also be seen in the image:\n"
                    "door: A blue wooden door.\nknob")


def test_urban1k_first_line_numeric_order_and_goal_placeholder_paths(tmp_path):
    u = tmp_path / "Urban1k"
    for n in (10, 2, 1):
        write_image(u / "image" / f"{n}.jpg", n)
        (u / "caption" / f"{n}.txt").parent.mkdir(parents=True, exist_ok=True)
        (u / "caption" / f"{n}.txt").write_text(f"caption {n}\nsecond line\n")
    d = long_sets.read_urban1k(u)
    assert d.captions == ["caption 1", "caption 2", "caption 10"]
    goal = tmp_path / "urban_dataset_test.json"
    goal.write_text(json.dumps([{"filename": "chage/path/to/your/directoryUrban1k/image/2.jpg", "caption": "c2"}]))
    g = long_sets.read_goal_list(goal, u / "image")
    assert g.images == [str(u / "image" / "2.jpg")]


def test_panoptic_stuff_box_from_png_and_tiny_segment_skipped(tmp_path):
    ids = np.zeros((32, 32), dtype=np.int64)
    ids[24:32, 0:32] = 6979964                    # stuff: tight box [0, 24, 32, 32]
    ids[2:22, 2:14] = 3226956                     # thing (bbox from the json)
    ids[0:2, 30:32] = 5                           # tiny thing 2x2 -> skipped
    rgb = np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
    (tmp_path / "panoptic_val2017").mkdir()
    Image.fromarray(rgb).save(tmp_path / "panoptic_val2017" / "000000000139.png")
    write_image(tmp_path / "val2017" / "000000000139.jpg", 1, size=(32, 32))
    pj = {"images": [{"id": 139, "file_name": "000000000139.jpg", "height": 32, "width": 32}],
          "annotations": [{"image_id": 139, "file_name": "000000000139.png", "segments_info": [
              {"id": 3226956, "category_id": 1, "iscrowd": 0, "bbox": [2, 2, 12, 20], "area": 240},
              {"id": 6979964, "category_id": 184, "iscrowd": 0, "bbox": [0, 0, 1, 1], "area": 256},
              {"id": 5, "category_id": 18, "iscrowd": 0, "bbox": [30, 0, 2, 2], "area": 4}]}],
          "categories": [{"id": 1, "name": "person", "isthing": 1}, {"id": 18, "name": "dog", "isthing": 1},
                         {"id": 184, "name": "tree-merged", "isthing": 0}]}
    (tmp_path / "panoptic_val2017.json").write_text(json.dumps(pj))
    d = box_sets.read_panoptic(tmp_path / "panoptic_val2017.json", tmp_path / "val2017")
    assert d.classnames == ["person", "dog", "tree-merged"]
    assert d.labels == [0, 2] and d.skipped["small_or_huge"] == 1
    assert d.images[0][1].tolist() == [[2, 2, 14, 22], [0, 24, 32, 32]]



def test_panoptic_keeps_crowd_segments_labels_by_sorted_ids_and_reads_100_segments_per_image(tmp_path):
    """FineCLIP/CLIPSelf `COCOPanopticDataset`: every segment is a box (crowd ones too, unlike instances), the label
    is the index in the sorted category ids (things and stuff in one label space), at most 100 per image."""
    ids = np.zeros((40, 200), dtype=np.int64)
    ids[30:40, :] = 9000                                   # stuff (wall): tight box [0, 30, 200, 40]
    rgb = np.stack([ids % 256, ids // 256 % 256, ids // 65536], -1).astype(np.uint8)
    (tmp_path / "masks").mkdir()
    Image.fromarray(rgb).save(tmp_path / "masks" / "000000000001.png")
    write_image(tmp_path / "val2017" / "000000000001.jpg", 1, size=(200, 40))
    things = [{"id": 100 + k, "category_id": 1, "iscrowd": 0, "bbox": [2 * k, 0, 9, 9], "area": 81}
              for k in range(99)]
    crowd = {"id": 99, "category_id": 18, "iscrowd": 1, "bbox": [0, 10, 20, 10], "area": 200}
    segs = [crowd] + things[:98] + [{"id": 9000, "category_id": 199, "iscrowd": 0, "bbox": [0, 0, 1, 1],
                                     "area": 2000}] + things[98:]                      # 101 segments
    pj = {"images": [{"id": 1, "file_name": "000000000001.jpg", "height": 40, "width": 200}],
          "annotations": [{"image_id": 1, "file_name": "000000000001.png", "segments_info": segs}],
          "categories": [{"id": 199, "name": "wall-other-merged", "isthing": 0},
                         {"id": 18, "name": "dog", "isthing": 1},
                         {"id": 1, "name": "person", "isthing": 1}]}
    (tmp_path / "panoptic_val2017.json").write_text(json.dumps(pj))
    d = box_sets.load_box_set({"panoptic": str(tmp_path / "panoptic_val2017.json"), "images": str(tmp_path / "val2017"),
                              "panoptic_masks": str(tmp_path / "masks")})
    assert d.classnames == ["person", "dog", "wall-other-merged"]          # ids 1 < 18 < 199
    assert len(d.labels) == 100 and d.skipped["over_100_segments"] == 1      # the 101st (a thing) is not read
    assert d.labels[0] == 1 and d.labels[-1] == 2 and d.labels.count(0) == 98   # crowd dog kept; stuff last read
    boxes = d.images[0][1]
    assert boxes[0].tolist() == [0, 10, 20, 20] and boxes[-1].tolist() == [0, 30, 200, 40]
    assert d.skipped["crowd"] == 0

def test_lvis_image_folder_from_coco_url_and_frequency_buckets(tmp_path):
    write_image(tmp_path / "train2017" / "000000155379.jpg", 1, size=(32, 32))
    lv = {"images": [{"id": 155379, "height": 32, "width": 32,
                      "coco_url": "http://images.cocodataset.org/train2017/000000155379.jpg"}],
          "annotations": [{"id": 1, "image_id": 155379, "category_id": 2, "bbox": [1, 1, 10, 10], "area": 100},
                          {"id": 2, "image_id": 155379, "category_id": 3, "bbox": [12, 12, 10, 10], "area": 100}],
          "categories": [{"id": 1, "name": "aerosol_can", "frequency": "c"},
                         {"id": 2, "name": "air_conditioner", "frequency": "f"},
                         {"id": 3, "name": "applesauce", "frequency": "r"}]}
    (tmp_path / "lvis_v1_val.json").write_text(json.dumps(lv))
    d = box_sets.read_lvis(tmp_path / "lvis_v1_val.json", tmp_path)
    assert d.classnames == ["aerosol can", "air conditioner", "applesauce"] and d.labels == [1, 2]
    m = box_cls.box_metrics(np.array([[0, 1.0, 0], [0, 1.0, 0]]), d.labels, d.frequency)
    assert (m["macc1_f"], m["macc1_r"], m["macc1_c"]) == (100.0, 0.0, None)


def test_vild_prompts_with_this_is_prefix():
    p = box_cls.class_prompts("apple")
    assert len(p) == 63
    assert p[0] == "There is an apple in the scene."
    assert p[2] == "This is a photo of an apple in the scene."
    assert "This is the plastic apple." in p and "This is an embroidered apple." in p


def test_vg_relation_macro_excludes_symmetric_and_vga_needs_25(tmp_path):
    write_image(tmp_path / "images" / "vg.png", 41)
    rels = [("sitting on", True), ("sitting on", False), ("riding", True), ("next to", False), ("beside", False)]
    vgr = [{"image_path": "vg.png", "bbox_x": 0, "bbox_y": 0, "bbox_w": 8, "bbox_h": 8, "relation_name": r,
            "true_caption": f"id41 {r}" if ok else f"id40 {r}", "false_caption": f"id40 false {r}"}
           for r, ok in rels]
    # a tie (true and false both id40) is wrong: ARO argmax picks index 0 = false caption
    vga = ([{"image_path": "vg.png", "bbox_x": 0, "bbox_y": 0, "bbox_w": 8, "bbox_h": 8, "attributes": ["red", "blue"],
             "true_caption": "id41 t", "false_caption": "id40 f"}] * 20
           + [{"image_path": "vg.png", "bbox_x": 0, "bbox_y": 0, "bbox_w": 8, "bbox_h": 8,
               "attributes": ["red", "blue"],
               "true_caption": "id40 t", "false_caption": "id40 f"}] * 5
           + [{"image_path": "vg.png", "bbox_x": 0, "bbox_y": 0, "bbox_w": 8, "bbox_h": 8,
               "attributes": ["big", "small"],
               "true_caption": "id40 t", "false_caption": "id41 f"}] * 24)
    (tmp_path / "visual_genome_relation.json").write_text(json.dumps(vgr))
    (tmp_path / "visual_genome_attribution.json").write_text(json.dumps(vga))
    enc = Encoder(FakeModel(world.perfect_image_vec, world.perfect_text_vec), 8)
    m = comp.evaluate_vg(enc, comp_sets.read_vg(tmp_path, tmp_path / "images"))
    # non-symmetric relations: "sitting on" 1/2, "riding" 1/1 -> macro 75 (micro 2/5 = 40)
    assert m["vg_relation"] == pytest.approx(75.0) and m["n_vg_relation_groups"] == 2
    assert m["vg_relation_micro"] == pytest.approx(40.0)
    # only red_blue has >= 25 cases: 20/25; big_small (24 cases, all wrong) excluded
    assert m["vg_attribution"] == pytest.approx(80.0) and m["n_vg_attribution_groups"] == 1
    assert "next to" in comp.ARO_SYMMETRIC_RELATIONS and "sitting on" not in comp.ARO_SYMMETRIC_RELATIONS


def test_vg_crops_the_image_to_the_box(tmp_path):
    write_image(tmp_path / "images" / "g.png", [[41, 40], [40, 40]], size=(32, 32))
    vgr = [{"image_path": "g.png", "bbox_x": x, "bbox_y": 0, "bbox_w": 16, "bbox_h": 16, "relation_name": "on",
            "true_caption": "id41 yes", "false_caption": "id40 no"} for x in (0, 16)]
    (tmp_path / "visual_genome_relation.json").write_text(json.dumps(vgr))
    enc = Encoder(FakeModel(world.perfect_image_vec, world.perfect_text_vec), 8)
    assert comp.evaluate_vg(enc, comp_sets.read_vg(tmp_path, tmp_path / "images"))["vg_relation_micro"] \
        == pytest.approx(50.0)


def test_valse_filter_drops_low_agreement_samples(tmp_path):
    cfg = world.build(tmp_path)["valse"]["sample"]
    data = comp_sets.read_valse(cfg["dir"], cfg["images"])
    assert [r["caption"] for r in data["relations"]] == ["cup id51 on table"]


def test_pre_caption_and_order_options_are_permutations():
    assert aro_order.pre_caption('A "Dog" (big); runs.  Fast!') == "a dog big runs fast"
    assert aro_order.pre_caption(" ".join(["w"] * 40)) == " ".join(["w"] * 30)
    toks = ["a", "red", "square", "left", "of", "a", "blue", "circle"]
    tags = ["DT", "JJ", "NN", "RB", "IN", "DT", "JJ", "NN"]
    opts = aro_order.Shuffler(seed=1).options(toks, tags, " ".join(toks))
    assert len(opts) == 5 and opts[0] == "a red square left of a blue circle"
    for o in opts[1:]:
        assert sorted(o.split()) == sorted(toks)
    # nouns/adjectives stay in noun/adjective slots in option 1; others stay in place in option 2
    o1, o2 = opts[1].split(), opts[2].split()
    assert {o1[2], o1[7]} == {"square", "circle"} and {o1[1], o1[6]} == {"red", "blue"}
    assert [o2[i] for i in (1, 2, 6, 7)] == ["red", "square", "blue", "circle"]
    assert aro_order.Shuffler(seed=1).options(toks, tags, " ".join(toks)) == opts      # seeded


def test_cached_tagger_tags_once_and_keys_on_the_captions(tmp_path, monkeypatch):
    caps = ["a red square left of a blue circle", "two dogs run on the grass"]
    fresh = aro_order.spacy_tagger()(caps)
    assert aro_order.cached_tagger(tmp_path)(caps) == fresh              # first call: spaCy, then written
    assert len(list(tmp_path.glob("pos_tags-*.json"))) == 1

    def no_spacy():
        raise AssertionError("spaCy loaded although the tags are cached")
    monkeypatch.setattr(aro_order, "spacy_tagger", no_spacy)
    assert aro_order.cached_tagger(tmp_path)(caps) == fresh              # second call: from the file alone
    with pytest.raises(AssertionError, match="spaCy loaded"):
        aro_order.cached_tagger(tmp_path)(caps[:1])                      # other captions: another key


def test_order_argmax_first_maximum_wins():
    s = np.array([[0.5, 0.5, 0.1, 0.1, 0.1],      # tie with the original -> original (index 0) -> correct
                  [0.4, 0.5, 0.1, 0.1, 0.1],
                  [0.9, 0.1, 0.2, 0.3, 0.4]])
    assert aro_order.order_correct(s).tolist() == [True, False, True]


# ---- released forms (issue #24): Winoground stems, CLIP_benchmark templates, DOCCI qual_test, GOAL crop names
def test_winoground_released_examples_name_images_by_stem_in_images_folder(tmp_path):
    """HF facebook/winoground `data/examples.jsonl` + `data/images/ex_<id>_img_<k>.png` (images.zip)."""
    for ex in (0, 1):
        for k in (0, 1):
            write_image(tmp_path / "images" / f"ex_{ex}_img_{k}.png", 10 * ex + k + 1)
    (tmp_path / "examples.jsonl").write_text("".join(json.dumps(
        {"id": ex, "image_0": f"ex_{ex}_img_0", "image_1": f"ex_{ex}_img_1",
         "caption_0": "an old person kisses a young person", "caption_1": "a young person kisses an old person",
         "tag": "Noun", "secondary_tag": "", "num_main_preds": 1, "collapsed_tag": "Object"}) + "\n" for ex in (0, 1)))
    data = comp_sets.read_winoground(tmp_path)
    assert [r["images"] for r in data] == [[str(tmp_path / "images" / f"ex_{ex}_img_{k}.png") for k in (0, 1)]
                                          for ex in (0, 1)]
    (tmp_path / "images" / "ex_1_img_1.png").unlink()
    with pytest.raises(InputError, match="ex_1_img_1"):
        comp_sets.read_winoground(tmp_path)


def clip_benchmark_templates():
    """The shape of CLIP_benchmark's `en_zeroshot_classification_templates.json`: dataset -> templates."""
    return {"cifar10": [f"a photo of a {{c}} ({i})." for i in range(18)],
            "imagenet1k": ["a bad photo of a {c}.", "a sculpture of a {c}.", "itap of a {c}."],
            "cars": ["a photo of a {c}, a type of car."]}


def test_zeroshot_multi_dataset_templates_take_the_named_dataset(tmp_path):
    cfg = world.build(tmp_path)["zeroshot"]["sample"]
    zs = Path(cfg["dir"])
    (zs / "templates.txt").unlink()
    (zs / "templates.json").write_text(json.dumps(clip_benchmark_templates()))
    assert zeroshot_sets.read_image_folder(zs, templates_key="imagenet1k").templates == \
        clip_benchmark_templates()["imagenet1k"]
    with pytest.raises(InputError, match=r"templates\.json.*'sample'"):
        zeroshot_sets.read_image_folder(zs, templates_key="sample")


def test_zeroshot_suite_keys_templates_by_set_name_or_templates_key(tmp_path, monkeypatch):
    cfg = world.build(tmp_path)["zeroshot"]["sample"]
    zs = Path(cfg["dir"])
    (zs / "templates.txt").unlink()
    (zs / "templates.json").write_text(json.dumps(clip_benchmark_templates()))
    seen = {}
    monkeypatch.setattr(zeroshot, "evaluate_zeroshot", lambda enc, data, items: seen.setdefault("t", data.templates))
    suite.run_benchmark("zeroshot", {"dir": str(zs)}, None, None, {}, "zeroshot.cars")
    assert seen.pop("t") == clip_benchmark_templates()["cars"]
    suite.run_benchmark("zeroshot", {"dir": str(zs), "templates_key": "cifar10"}, None, None, {}, "zeroshot.mine")
    assert len(seen.pop("t")) == 18
    with pytest.raises(InputError, match="templates.json"):
        suite.run_benchmark("zeroshot", {"dir": str(zs)}, None, None, {}, "zeroshot.mine")


def test_docci_splits_option_adds_qual_test_in_file_order(tmp_path):
    cfg = world.build(tmp_path)["long_retrieval"]["sample"]
    d = long_sets.load_long_set(dict(cfg, splits=["test", "qual_test"]))
    assert [p.split("/")[-1] for p in d.images] == ["test_00000.png", "test_00001.png", "qual_test_00000.png"]
    assert len(long_sets.load_long_set(cfg).images) == 2          # default unchanged


def test_goal_crops_sharing_a_file_name_resolve_by_relative_path_or_fail(tmp_path):
    """GOAL lists name crops `<stem>.jpg_results/original_image.jpg` behind a placeholder prefix."""
    root = tmp_path / "crops"
    for stem, k in (("a", 1), ("b", 2)):
        write_image(root / f"{stem}.jpg_results" / "original_image.jpg", k)
    goal = tmp_path / "docci_test.json"
    goal.write_text(json.dumps([{"filename": f"chage/path/to/{s}.jpg_results/original_image.jpg", "caption": s}
                                for s in ("a", "b")]))
    d = long_sets.read_goal_list(goal, root)
    assert d.images == [str(root / f"{s}.jpg_results" / "original_image.jpg") for s in ("a", "b")]
    flat = tmp_path / "flat"                             # only the file name can match: ambiguous
    write_image(flat / "original_image.jpg", 1)
    with pytest.raises(InputError, match=r"docci_test\.json.*ambiguous"):
        long_sets.read_goal_list(goal, flat)


def test_goal_joint_list_crops_sharing_a_file_name_fail_when_only_the_name_matches(tmp_path):
    from clipfinetune.data.evalsets import global_local

    images = tmp_path / "images"
    write_image(images / "a.jpg", 1)
    write_image(images / "b.jpg", 2)
    write_image(images / "original_image.jpg", 3)          # the crops' folders are not under the images root
    joint = tmp_path / "lists" / "joint_test.json"
    joint.parent.mkdir()
    joint.write_text(json.dumps(
        [{"filename": f"chage/path/{s}.jpg", "caption": f"global {s}"} for s in ("a", "b")]
        + [{"filename": f"chage/path/{s}.jpg_results/original_image.jpg", "caption": f"local {s}"}
           for s in ("a", "b")]))
    with pytest.raises(InputError, match=r"joint_test\.json.*ambiguous"):
        global_local.read_joint_list(joint, images)
    for s, k in (("a", 4), ("b", 5)):
        write_image(images / f"{s}.jpg_results" / "original_image.jpg", k)
    records = global_local.read_joint_list(joint, images)
    assert [r.image[0] for r in records if r.is_local] == \
        [str(images / f"{s}.jpg_results" / "original_image.jpg") for s in ("a", "b")]


def test_retrieval_from_a_coco_captions_file_keeps_every_image_with_its_captions_in_file_order(tmp_path):
    """HarmoCLIP's COCO val2017 retrieval set: `coco_captions: captions_val2017.json` + `images: val2017`."""
    for i in (139, 285):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{i:012d}.jpg")
    (tmp_path / "captions_val2017.json").write_text(json.dumps({
        "images": [{"id": 285, "file_name": "000000000285.jpg", "width": 8, "height": 8},
                   {"id": 139, "file_name": "000000000139.jpg", "width": 8, "height": 8}],
        "annotations": [{"id": 3, "image_id": 285, "caption": "a bear"},
                        {"id": 1, "image_id": 139, "caption": "a room"},
                        {"id": 2, "image_id": 285, "caption": "  a  brown bear "}]}))
    data = retrieval_sets.load_retrieval_set({"coco_captions": str(tmp_path / "captions_val2017.json"),
                                              "images": str(tmp_path)})
    assert [p.rsplit("/", 1)[-1] for p in data.images] == ["000000000139.jpg", "000000000285.jpg"]
    assert data.captions == ["a room", "a bear", "a brown bear"] and data.caption_image == [0, 1, 1]
