"""README's real-data path, its four commands as written, from an empty `datasets/` to a trained and evaluated paper:
`clipfinetune recipe harmoclip`, `clipfinetune data --fetch` against a local mirror of the sources
(tests/fixtures/data_server.py: the miniature real tree packed as each source packs it), `clipfinetune plan`,
`dvc exp run -n harmoclip`. Between them, only what a user does by hand: Flickr30K's images placed (a form, no
direct link) and, as tests/scale/test_real_profile_dag.py, the compute scaled down (a tiny exported CLIP for the
pretrained weights, one epoch, tiny batches). Minutes on 2 CPU cores: `make test-scale`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from fixtures.data_server import miniature_mirror, serve
from fixtures.project import RAN, copy_project, env, run, write_params

from clipfinetune.project import data
from scale.test_real_profile_dag import CPU, WEIGHTS

pytestmark = pytest.mark.dag

PAPER = "harmoclip"
SMALL = {"epochs": 1, "batch_size": 2, "warmup": 1}
STAGES = {"plan@repro", "word_regions@coco", "pretrain", "code", "run_settings", "shards", "evalsets",
          f"train@{PAPER}", f"eval@{PAPER}", "eval_base", "report"}


def _readme_commands() -> list[str]:
    text = (data.MANIFEST.parents[2] / "README.md").read_text()
    section = text.split("## Real data and the papers", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.split("#", 1)[0].strip()]


@pytest.fixture(scope="module")
def fetched_and_run(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    base = tmp_path_factory.mktemp("fetch-repro")
    mirror = miniature_mirror(base)
    tree, manifest_path = mirror["tree"], mirror["manifest_path"]
    repo = copy_project(base / "project")
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    run(repo, "git", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project")
    recipe, fetch, plan, exp = _readme_commands()
    rec = {"repo": repo}
    with serve(base / "mirror") as (url, server):
        environ = {**env(), data.MIRROR_ENV: url, data.MANIFEST_ENV: str(manifest_path)}
        call = lambda command: subprocess.run(command.split(), cwd=repo, env=environ, capture_output=True, text=True,
                                              check=False)
        rec["recipe"] = call(recipe)
        rec["fetch"] = call(fetch)                         # everything but the manual Flickr30K images
        shutil.copytree(tree / "datasets/flickr30k", repo / "datasets/flickr30k")
        rec["fetch_again"] = call(fetch)
        server.requests.clear()
        rec["fetch_third"] = call(fetch)
        rec["requests_third"] = list(server.requests)
    write_params(repo, {**CPU, "train": {**CPU["train"], PAPER: SMALL}})     # compute only: no path, no layout
    rec["plan"] = call(plan + " --gpus 0")
    rec["exp"] = call(exp)
    rec["ran"] = RAN.findall(rec["exp"].stdout)
    return rec


def test_the_four_commands_bring_an_empty_datasets_folder_to_a_trained_and_evaluated_paper(fetched_and_run):
    r = fetched_and_run
    assert r["recipe"].returncode == 0, r["recipe"].stderr
    assert r["fetch"].returncode == 1 and "flickr30k" in r["fetch"].stdout and "manual steps" in r["fetch"].stdout
    assert r["fetch_again"].returncode == 0, r["fetch_again"].stdout + r["fetch_again"].stderr   # the placed one found
    assert r["fetch_third"].returncode == 0 and r["requests_third"] == []                        # nothing fetched again
    assert r["plan"].returncode == 0 and "plan: OK" in r["plan"].stdout, r["plan"].stdout[-3000:]
    assert r["exp"].returncode == 0, (r["exp"].stdout + r["exp"].stderr)[-4000:]
    assert set(r["ran"]) == STAGES, r["ran"]
    assert not (r["repo"] / "data/sample").exists()
    assert (r["repo"] / "datasets/.fetched/coco_train2017.json").is_file()
    assert os.path.isdir(r["repo"] / "datasets/coco/annotations/panoptic_val2017")
    assert not (r["repo"] / "datasets/.tmp").exists() or not list((r["repo"] / "datasets/.tmp").iterdir())
