"""`python -m research.binding_oracle` end to end on a tiny world and a random base (issue 35's probe): every
variant trains the regime's steps and is scored on every metric the probe reports."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from clipfinetune.models import export_model, load_model
from clipfinetune.sample.world import WorldConfig, generate_world
from research import binding_oracle

REPO = Path(__file__).resolve().parents[2]


def test_the_probe_trains_and_scores_every_variant(tmp_path):
    generate_world(tmp_path / "data" / "sample", WorldConfig(
        n_train=130, n_val=24, n_docci_train=2, n_docci_test=2, n_compositional=12, n_zeroshot_per_class=1,
        n_pretrain=8))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["batch_size"] = 32
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    export_model(load_model(params["model"]["name"]), tmp_path / "models" / "base")
    out = tmp_path / "probe.json"
    results = binding_oracle.main(["--root", str(tmp_path), "--epochs", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["setup"]["train_images"] == 130 and results["setup"]["with_binding_pairs"] > 60
    keys = set(binding_oracle.THRESHOLDS) | set(binding_oracle.TARGETS) | {"swap_att_text_cosine",
                                                                           "image_probe_swap_att", "train_pairs"}
    for name in ("base", "clip", "binding", "oracle"):
        assert keys <= set(results[name]), name
        assert all(0 <= results[name][k] <= 100 for k in binding_oracle.TARGETS)
        assert -1 <= results[name]["swap_att_text_cosine"] <= 1 and 0 <= results[name]["train_pairs"] <= 100
    assert {results[v]["steps"] for v in ("clip", "binding", "oracle")} == {130 // 32}
    shutil.rmtree(tmp_path / "data")
