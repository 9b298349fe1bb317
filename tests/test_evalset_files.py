"""Eval stages depend on the evaluation-set files they read: `clipfinetune.data.evalsets.sets.evalset_files` lists
them by each set's own reader, stage `evalsets` writes their sizes and digests to data/evalsets.json, and every
eval@<model> depends on that file. Unit tests on the evaluation test world; the DVC run on the tiny sample world that
edits a configured evaluation-set file in place and checks which stages re-run is tests/scale/test_evalset_rerun.py
(minutes).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fixtures.eval import world
from fixtures.eval.fakes import write_image

from clipfinetune import leakage
from clipfinetune.data.evalsets.sets import evalset_files, evalset_manifest, read_set
from clipfinetune.io import InputError
from clipfinetune.project import profile

ROOT = Path(__file__).resolve().parents[1]


def _rel(paths, root) -> set[str]:
    return {os.path.relpath(p, root) for p in paths}


@pytest.fixture
def bench(tmp_path):
    cfg = world.build(tmp_path)
    write_image(tmp_path / "aro" / "images" / "unused.png", 99)            # in ARO's folder, scored by nothing
    write_image(tmp_path / "zeroshot" / "train" / "a_cls" / "0.png", 98)   # another split of the zero-shot folder
    (tmp_path / "sugarcrepe" / "README.md").write_text("notes\n")          # any other file of an annotation folder
    return cfg


EXPECTED = {   # the files each set of tests/fixtures/eval/world.py reads (Karpathy's train image 9 is not tested)
    ("retrieval", "sample"): {"karpathy/dataset_coco.json", "images/val/1.png", "images/val/2.png", "images/val/3.png"},
    ("long_retrieval", "sample"): {"docci/descriptions.jsonlines", "docci/images/test_00000.png",
                                   "docci/images/test_00001.png"},
    ("global_local", "sample"): {"prepared/global_local_test.json", "docci/images/sa_1.png", "docci/images/sa_2.png"},
    ("box_cls", "sample"): {"box_cls/instances_shape.json", "images/val/40.png"},
    ("sugarcrepe", "sample"): {"sugarcrepe/swap_att.json", "sugarcrepe/add_obj.json", "sugarcrepe/README.md",
                               "images/val/31.png", "images/val/32.png"},
    ("aro", "sample"): {"aro/visual_genome_relation.json", "aro/visual_genome_attribution.json", "aro/images/vg1.png",
                        "karpathy/coco_karpathy_test.json", "images/val/1.png", "images/val/2.png", "images/val/3.png"},
    ("valse", "sample"): {"valse/relations.json", "valse/images/v1.png"},
    ("winoground", "sample"): {"winoground/examples.jsonl"} | {f"winoground/ex_{e}_img_{i}.png" for e in (0, 1)
                                                                for i in (0, 1)},
    ("zeroshot", "sample"): {"zeroshot/classnames.txt", "zeroshot/templates.txt"}
    | {f"zeroshot/test/{c}/{n}.png" for c in ("a_cls", "b_cls", "c_cls") for n in (0, 1)},
}


@pytest.mark.parametrize("task,name", sorted(EXPECTED))
def test_benchmark_files_are_the_annotation_files_and_the_scored_images(bench, tmp_path, task, name):
    assert _rel(evalset_files(task, bench[task][name], name), tmp_path) == EXPECTED[(task, name)]


def test_the_leakage_check_compares_the_images_the_evaluation_scores(bench, tmp_path):
    sets = leakage.evaluation_sets(bench)
    for (task, name), expected in EXPECTED.items():
        images = [r.path for r in sets[f"{task}.{name}"]]
        assert images == read_set(task, bench[task][name], name).images, task
        assert _rel(images, tmp_path) == {p for p in expected if p.endswith(".png")}, task


def test_the_manifest_changes_exactly_when_a_file_changes(bench, tmp_path):
    cache = tmp_path / "cache"
    first, cost = evalset_manifest(bench, cache)
    assert set(first) == {f"{t}.{n}" for t, n in EXPECTED}                 # box_cls_hard: {} is no set
    assert cost["files"] == sum(map(len, EXPECTED.values()))
    assert cost["files_hashed"] == len(set().union(*EXPECTED.values()))   # a file two sets read is hashed once
    again, cost = evalset_manifest(bench, cache)
    assert again == first and cost["files_hashed"] == 0                   # cached: one stat per file
    image = tmp_path / "images" / "val" / "31.png"
    os.utime(image, ns=(1, 1))                                            # touched, same bytes: same manifest
    assert evalset_manifest(bench, cache)[0] == first
    write_image(image, 77)                                                # edited in place
    edited, _ = evalset_manifest(bench, cache)
    changed = {(s, f) for s in first for f in first[s] if first[s][f] != edited[s][f]}
    assert changed == {("sugarcrepe.sample", str(image))}


def test_a_missing_benchmark_file_is_an_error_naming_it(bench, tmp_path):
    (tmp_path / "images" / "val" / "40.png").unlink()
    with pytest.raises(InputError, match="40.png"):
        evalset_manifest({"box_cls": bench["box_cls"]}, tmp_path / "cache")


NO_LISM = {"segments": {"sources": []}, "lism": {"sources": []}}     # the sample world without GOAL's data stages
PROFILES = [[], [NO_LISM], ["params.real.yaml"]] + \
    [["params.real.yaml", f"recipes/{r}.yaml"] for r in ("harmoclip", "fsc_clip", "goal", "degla", "mulclip")]


def _leaves(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _leaves(v)
    elif isinstance(node, str) and node:
        yield node


@pytest.mark.parametrize("names", PROFILES, ids=lambda n: "+".join("no_lism" if isinstance(x, dict) else Path(x).stem
                                                                   for x in n) or "sample")
def test_every_stage_that_writes_a_configured_benchmark_file_runs_before_the_evalsets_stage(tmp_path, names):
    """The manifest must be written after the stages that write evaluation-set files (DAG order): in every profile (the
    committed params.yaml + the profiles, as `clipfinetune recipe` writes them), a stage whose output holds a
    configured benchmark path is upstream of stage `evalsets`."""
    import networkx as nx
    import yaml
    from dvc.repo import Repo
    from fixtures.project import committed_params

    params = profile.layered(committed_params(), *(n if isinstance(n, dict) else profile.load_plain(ROOT / n)
                                                   for n in names))
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    Repo.init(str(tmp_path), no_scm=True)
    with Repo(str(tmp_path)) as repo:
        graph = repo.index.graph                                   # edges: a stage -> the stages it depends on
        (bench,) = [s for s in graph if s.name == "evalsets"]
        assert bench.always_changed
        upstream = nx.descendants(graph, bench)
        writers = 0
        for value in _leaves(params["eval"]["evalsets"]):
            for stage in graph:
                if any(Path(value) == Path(o.def_path) or Path(o.def_path) in Path(value).parents for o in stage.outs):
                    assert stage in upstream, (names, value, stage.name)
                    writers += 1
    assert writers or "params.real.yaml" in names, "the sample world's sets lie in data/sample (stage sample@world)"
