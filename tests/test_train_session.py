"""The wiring every training entry point shares (clipfinetune/train/session.py): the global batch split per rank,
the settings and the seed, the device rule, and the main rank's export with its record."""
from __future__ import annotations

import json

import pytest
import torch
from fixtures.methods import tiny_model

from clipfinetune.distributed import DistInfo
from clipfinetune.train.session import training_session

SETTINGS = {"epochs": 1, "batch_size": 8, "lr": 1e-3, "seed": 5, "checkpoint_every": 2}


def test_a_session_splits_the_global_batch_seeds_and_takes_the_device_rule(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with training_session(SETTINGS, "fp32", "cpu") as session:
        drawn = torch.rand(3)
        assert session.dist.device == torch.device("cpu") and session.global_batch == 8
        assert session.cfg.batch_size == 8 and session.cfg.seed == 5 and session.cfg.checkpoint_every == 2
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3))                   # seeded with the settings' seed on the way in


def test_a_global_batch_the_ranks_cannot_split_is_an_error_naming_the_param(monkeypatch):
    three_ranks = DistInfo(rank=0, local_rank=0, world_size=3, device=torch.device("cpu"))
    monkeypatch.setattr("clipfinetune.train.session.init_distributed", lambda device: three_ranks)
    with pytest.raises(ValueError, match="pretrain.batch_size 8"), \
            training_session(SETTINGS, "fp32", "cpu", batch_param="pretrain.batch_size"):
        pass


def test_the_export_writes_the_model_and_its_record_and_removes_the_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"x")
    with training_session(SETTINGS, "fp32", "cpu") as session:
        session.export(tiny_model(), tmp_path / "model", live_dir=tmp_path / "live", record={"samples": 3},
                       checkpoint_dir=tmp_path / "checkpoints", keep_checkpoint=False)
    assert (tmp_path / "model" / "open_clip_config.json").is_file()
    assert json.loads((tmp_path / "live" / "data.json").read_text()) == {
        "samples": 3, "device": "cpu", "ranks": 1, "global_batch": 8, "rank_batch": 8, "precision": "fp32"}
    assert not (tmp_path / "checkpoints").exists()
