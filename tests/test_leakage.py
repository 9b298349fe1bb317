"""clipfinetune.leakage: training images found in evaluation sets, by COCO id and by the bytes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from clipfinetune import leakage
from clipfinetune.io import InputError


def _image(path: Path, colour) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), colour).save(path)
    return path


@pytest.fixture
def tree(tmp_path):
    """COCO train2017 (ids 9, 42) and a Karpathy test over val2014 (ids 42, 73): image 42 is in both, as in COCO."""
    for i, cid in enumerate((9, 42)):
        _image(tmp_path / "train2017" / f"{cid:012d}.jpg", (10 * i, 200, 30))
    captions = {"images": [{"id": cid, "file_name": f"{cid:012d}.jpg", "width": 16, "height": 12} for cid in (9, 42)],
                "annotations": [{"id": cid, "image_id": cid, "caption": "a thing"} for cid in (9, 42)]}
    (tmp_path / "captions_train2017.json").write_text(json.dumps(captions))
    karpathy = []
    for n, cid in enumerate((42, 73)):
        name = f"COCO_val2014_{cid:012d}.jpg"
        # other bytes than train2017/42: only the id is shared
        _image(tmp_path / "val2014" / name, (250, 10 * n, 90))
        karpathy.append({"filepath": "val2014", "filename": name, "imgid": n, "cocoid": cid, "split": "test",
                         "sentences": [{"raw": "a photo"}]})
    (tmp_path / "dataset_coco.json").write_text(json.dumps({"images": karpathy}))
    return tmp_path


def _coco(tree) -> dict:
    return {"reader": "coco", "captions": str(tree / "captions_train2017.json"), "images": str(tree / "train2017")}


def _train(tree):
    return leakage.training_images({"coco": _coco(tree)})


def _karpathy(tree):
    return leakage.evaluation_sets({"retrieval": {"real": {"karpathy": str(tree / "dataset_coco.json"),
                                                           "images": str(tree)}}})


def test_coco_ids_come_from_either_file_naming():
    assert leakage.coco_id_of("val2014/COCO_val2014_000000000042.jpg") == 42
    assert leakage.coco_id_of("train2017/000000000042.jpg") == 42
    assert leakage.coco_id_of("flickr30k-images/1000092795.jpg") is None
    assert leakage.coco_id_of("docci/images/test_00001.jpg") is None


def test_a_shared_coco_id_is_a_leak_even_when_the_files_differ(tree):
    overlaps, _ = leakage.find_overlaps(_train(tree), _karpathy(tree))
    assert [(o.eval_set, o.by_id, o.by_content, o.count) for o in overlaps] == [("retrieval.real", [42], [], 1)]
    with pytest.raises(leakage.LeakageError) as err:
        leakage.refuse(overlaps)
    assert "evaluation set retrieval.real: 1 of its images are training images" in str(err.value)
    assert "1 by COCO id (first: 42)" in str(err.value)


def test_a_renamed_copy_is_a_leak_by_content(tree):
    renamed = tree / "val2014" / "holiday.jpg"                       # no COCO id in the name
    shutil.copyfile(tree / "train2017" / "000000000009.jpg", renamed)
    evals = {"zeroshot.pets": [leakage.ImageRef(str(renamed))]}
    overlaps, _ = leakage.find_overlaps(_train(tree), evals)
    assert [(o.eval_set, o.by_id, o.by_content) for o in overlaps] == [
        ("zeroshot.pets", [], [(str(tree / "train2017" / "000000000009.jpg"), str(renamed))])]
    assert leakage.find_overlaps(_train(tree), evals, content=False)[0] == []       # ids alone cannot see it


def test_disjoint_sets_pass(tree):
    train = [r for r in _train(tree) if r.coco_id != 42]
    assert leakage.find_overlaps(train, _karpathy(tree))[0] == []


def test_digests_are_hashed_once_and_reused_from_the_cache(tree, tmp_path):
    renamed = tree / "val2014" / "holiday.jpg"
    shutil.copyfile(tree / "train2017" / "000000000009.jpg", renamed)
    evals = {"x.y": [leakage.ImageRef(str(renamed))]}
    cache = tmp_path / "cache"
    first = leakage.find_overlaps(_train(tree), evals, cache_dir=cache)
    second = leakage.find_overlaps(_train(tree), evals, cache_dir=cache)
    assert first[0][0].by_content == second[0][0].by_content != []
    assert first[1]["files_hashed"] > 0 and first[1]["digests_reused"] == 0
    assert second[1]["files_hashed"] == 0 and second[1]["digests_reused"] == first[1]["files_hashed"]
    _image(renamed, (1, 2, 3))                         # changed bytes (size/mtime): hashed again, no longer a copy
    third = leakage.find_overlaps(_train(tree), evals, cache_dir=cache)
    assert third[0] == []


def test_only_files_whose_size_another_side_has_are_hashed(tree, tmp_path):
    big = _image(tmp_path / "big.png", (5, 5, 5))
    big.write_bytes(big.read_bytes() + b"\0" * 4096)                    # a size no training image has
    evals = {"x.y": [leakage.ImageRef(str(big))]}
    overlaps, cost = leakage.find_overlaps(_train(tree), evals)
    assert overlaps == [] and cost["files_hashed"] == 0


def test_unreadable_evaluation_sets_are_reported_not_compared(tree):
    unreadable: dict = {}
    sets = leakage.evaluation_sets({"retrieval": {"real": {"karpathy": str(tree / "dataset_coco.json"),
                                                           "images": str(tree)},
                                                  "gone": {"karpathy": str(tree / "nope.json"), "images": "x"}},
                                    "valse": {}}, unreadable)
    assert list(sets) == ["retrieval.real"] and list(unreadable) == ["retrieval.gone"]
    with pytest.raises(InputError, match="nope.json"):
        leakage.evaluation_sets({"retrieval": {"gone": {"karpathy": str(tree / "nope.json"), "images": "x"}}})


def test_training_images_come_through_the_readers_and_archived_images_are_named(tree):
    unchecked: list = []
    refs = leakage.training_images({"coco": _coco(tree), "tars": {"reader": "wds", "shards": "x/{0..1}.tar"}},
                                   unchecked=unchecked)
    assert sorted((Path(r.path).name, r.coco_id) for r in refs) == [("000000000009.jpg", 9), ("000000000042.jpg", 42)]
    assert unchecked == ["tars"]


def test_karpathy_training_records_carry_the_coco_id_not_karpathys_position(tree):
    """The Karpathy file numbers images by position (imgid 0, 1) and by COCO (cocoid 42, 73): the COCO id counts."""
    karpathy = {"reader": "karpathy", "file": str(tree / "dataset_coco.json"), "images": str(tree)}
    refs = leakage.training_images({"k": karpathy})
    assert sorted(r.coco_id for r in refs) == [42, 73]
    overlaps, _ = leakage.find_overlaps(refs, {"retrieval.x": [leakage.ImageRef("train2017/000000000042.jpg", 42)]},
                                        content=False)
    assert [o.by_id for o in overlaps] == [[42]]


def test_the_selected_splits_and_excluded_coco_files_decide_what_is_trained_on(tree):
    karpathy = {"reader": "karpathy", "file": str(tree / "dataset_coco.json"), "images": str(tree)}
    assert leakage.training_images({"k": karpathy}, splits=["train"]) == []
    dropped = {**karpathy, "exclude": [str(tree / "captions_train2017.json")]}     # holds image 42
    assert [r.coco_id for r in leakage.training_images({"k": dropped})] == [73]


def test_records_already_read_give_the_same_images_as_reading_the_sources(tree):
    from clipfinetune.data.readers import read_sources

    sources = {"coco": _coco(tree)}
    records = read_sources(["coco"], sources)
    records["coco"] = records["coco"][:1]                 # what was passed is what is compared
    assert [r.coco_id for r in leakage.training_images(sources, records=records)] == [9]
    assert sorted(r.coco_id for r in leakage.training_images(sources)) == [9, 42]
