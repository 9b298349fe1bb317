"""Eval stages re-run when a benchmark file they read is edited in place, and only then: `dvc repro eval_base` on the
tiny sample world with an external benchmark set (as a real profile's datasets/...), edited caption, rewritten image
(stage `evalsets` writes their digests to data/evalsets.json, every eval depends on it). Minutes on 2 cores:
`make test-scale`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from fixtures.project import RAN, TINY, copy_project, run, write_params

from clipfinetune.eval.items import METRICS_KEY


def test_editing_a_benchmark_file_in_place_reruns_the_evals_and_only_then(tmp_path):
    repo = copy_project(tmp_path / "project")
    write_params(repo, TINY)
    run(repo, "git", "init", "-q")
    run(repo, "git", "add", "-A")
    run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tiny project")
    run(repo, "dvc", "repro", "sample")
    # a benchmark set outside every stage output, as a real profile's datasets/...: a copy of the sample Karpathy set
    ext = repo / "datasets" / "ext"
    shutil.copytree(repo / "data" / "sample" / "images" / "val", ext / "images" / "val")
    shutil.copy(repo / "data" / "sample" / "karpathy" / "dataset_coco.json", ext / "dataset_coco.json")
    write_params(repo, {"eval": {"evalsets": {"retrieval": {"ext": {"karpathy": "datasets/ext/dataset_coco.json",
                                                                      "images": "datasets/ext/images"}}}}})
    first = RAN.findall(run(repo, "dvc", "repro", "eval_base").stdout)
    assert {"evalsets", "eval_base"} <= set(first)
    metrics = json.loads((repo / "metrics" / "base.json").read_text())
    assert "ext" in metrics["retrieval"]
    import pyarrow.parquet as pq

    # the items file carries the metrics file: `report` depends on metrics/items alone
    meta = pq.read_schema(repo / "metrics" / "items" / "base.parquet").metadata
    assert meta[METRICS_KEY.encode()].decode() == (repo / "metrics" / "base.json").read_text()

    # unchanged: the manifest is re-listed, nothing else runs
    assert RAN.findall(run(repo, "dvc", "repro", "eval_base").stdout) == ["evalsets"]
    assert json.loads(run(repo, "dvc", "status", "--json", "eval_base").stdout) == {}

    # a caption of the external set edited in place
    data = json.loads((ext / "dataset_coco.json").read_text())
    test_image = next(im for im in data["images"] if im["split"] == "test")
    test_image["sentences"][0]["raw"] = "an edited caption"
    (ext / "dataset_coco.json").write_text(json.dumps(data))
    run(repo, "dvc", "repro", "--single-item", "evalsets")
    status = json.loads(run(repo, "dvc", "status", "--json", "eval_base").stdout)
    assert status == {"eval_base": [{"changed deps": {"data/evalsets.json": "modified"}}]}
    dry = RAN.findall(run(repo, "dvc", "repro", "--dry", "eval_base").stdout)
    assert dry == ["evalsets", "eval_base"]
    assert RAN.findall(run(repo, "dvc", "repro", "eval_base").stdout) == ["evalsets", "eval_base"]

    # an image of it rewritten in place (another picture, same name)
    image = ext / "images" / "val" / Path(test_image["filename"]).name
    shutil.copy(next(p for p in (ext / "images" / "val").iterdir() if p != image), image)
    assert RAN.findall(run(repo, "dvc", "repro", "eval_base").stdout) == ["evalsets", "eval_base"]
    assert RAN.findall(run(repo, "dvc", "repro", "eval_base").stdout) == ["evalsets"]
