"""dvc.yaml lists its stages in data-flow order: every stage after the stages whose outputs it reads, by DVC's own
graph of the committed dvc.yaml and params.yaml (a foreach stage's members count as the stage that lists them), so
the file reads top to bottom as the pipeline runs."""
from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _committed(name: str) -> str:
    return subprocess.run(["git", "show", f"HEAD:{name}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def out_of_order(dvc_text: str, params_text: str, tmp: Path) -> list[tuple[str, str]]:
    """(stage, a stage it reads from that dvc.yaml lists after it) for every such pair, by DVC's graph."""
    from dvc.repo import Repo

    (tmp / "dvc.yaml").write_text(dvc_text)
    (tmp / "params.yaml").write_text(params_text)
    Repo.init(str(tmp), no_scm=True)
    position = {name: i for i, name in enumerate(yaml.safe_load(dvc_text)["stages"])}
    with Repo(str(tmp)) as repo:
        edges = [(a.name, b.name) for a, b in repo.index.graph.edges]        # a reads an output of b
    group = lambda stage: stage.split("@", 1)[0]                            # train@clip -> train
    return sorted({(group(a), group(b)) for a, b in edges if position[group(a)] < position[group(b)]})


def test_dvc_yaml_lists_every_stage_after_the_stages_it_reads(tmp_path):
    assert out_of_order(_committed("dvc.yaml"), _committed("params.yaml"), tmp_path) == []


def test_a_stage_listed_before_its_inputs_is_found(tmp_path):
    """`shards` moved to the end of the file, where it stood once although `train` reads it."""
    dvc = yaml.safe_load(_committed("dvc.yaml"))
    stages = dvc["stages"]
    stages["shards"] = stages.pop("shards")
    stages["eval_base"] = {"vars": [{"key": "base"}], **stages["eval"]["do"]}    # the YAML merge key, resolved
    found = out_of_order(yaml.safe_dump(dvc, sort_keys=False), _committed("params.yaml"), tmp_path)
    assert ("train", "shards") in found and all(b == "shards" for _, b in found)
