"""Training and checkpoints: a SIGKILLed `stages/train.py` resumes to the uninterrupted run's exact weights; a
non-finite loss stops with a clear message and the last good checkpoint intact; a checkpoint carrying a pickle
payload is refused; truncated checkpoints and weights give a clear error naming the file."""
from __future__ import annotations

import random
import time

import pytest
import torch

from clipfinetune.io import InputError
from clipfinetune.train import CheckpointError, NonFiniteLossError, load_checkpoint

from .conftest import kill, run_stage, start_stage

pytestmark = pytest.mark.faults

TRAIN_INPUTS = ["data/shards", "models/base"]
WEIGHTS = "models/clip/open_clip_model.safetensors"
LAST = "checkpoints/clip/last.pt"


def test_sigkilled_training_resumes_to_the_same_weights(tiny_project, tmp_path):
    straight = tiny_project.clone(tmp_path / "straight", TRAIN_INPUTS)
    killed = tiny_project.clone(tmp_path / "killed", TRAIN_INPUTS)
    straight.set_params(train={"keep_checkpoint": True})   # its last step count; not in the fingerprint or weights
    run_stage(straight.root, "train@clip")
    rng = random.Random("train-kill")
    proc = start_stage(killed.root, "train@clip")
    t0 = time.perf_counter()
    while proc.poll() is None and not (killed / LAST).exists() and time.perf_counter() - t0 < 120:
        time.sleep(0.005)
    time.sleep(rng.uniform(0, 0.3))
    finished = proc.poll() is not None
    kill(proc)
    assert not finished, "training ended before the kill: make the tiny run longer"
    assert not (killed / "models/clip").exists(), "a killed run left an exported model"
    step = load_checkpoint(killed / LAST)["step"]
    total = load_checkpoint(straight / LAST)["step"]
    assert 1 <= step < total
    out = run_stage(killed.root, "train@clip")
    assert "resuming from" in out.stderr + out.stdout
    assert (killed / WEIGHTS).read_bytes() == (straight / WEIGHTS).read_bytes()


def test_non_finite_loss_stops_clearly_and_keeps_the_last_good_checkpoint(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", TRAIN_INPUTS)
    proj.set_params(train={"lr": 1.0e30, "warmup": 0, "grad_clip": 0.0})     # the weights blow up
    with pytest.raises(NonFiniteLossError) as err:
        inprocess(proj, "train@clip", "--run", "clip", "--method", "clip")
    message = str(err.value)
    assert "non-finite" in message and "optimiser step" in message
    ckpt = load_checkpoint(proj / LAST)
    assert f"last.pt (step {ckpt['step']}), intact" in message
    assert f"optimiser step {ckpt['step'] + 1}" in message           # the failing step was never saved
    assert not (proj / "models/clip").exists()


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))              # would create the marker file if unpickled


def test_checkpoint_with_a_pickle_payload_is_refused(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", TRAIN_INPUTS)
    marker = tmp_path / "payload-ran"
    (proj / LAST).parent.mkdir(parents=True)
    torch.save({"format": "clipfinetune-train-checkpoint/1", "step": 1, "x": Payload(str(marker))}, proj / LAST)
    with pytest.raises(CheckpointError, match="refused") as err:
        inprocess(proj, "train@clip", "--run", "clip", "--method", "clip")
    assert LAST in str(err.value)
    assert not marker.exists()

    weights = tmp_path / "evil.pt"                    # the same payload as `model.pretrained` weights
    torch.save({"state_dict": {"w": torch.zeros(1)}, "x": Payload(str(marker))}, weights)
    proj.set_params(model={"pretrained": str(weights)})
    with pytest.raises(InputError, match="refused") as err:
        inprocess(proj, "pretrain")
    assert str(weights) in str(err.value)
    assert not marker.exists()


def test_truncated_checkpoint_and_weights_name_the_file(tiny_project, tmp_path, inprocess):
    proj = tiny_project.clone(tmp_path / "p", TRAIN_INPUTS)
    proj.set_params(train={"keep_checkpoint": True})       # an exported run removes its checkpoint otherwise
    run_stage(proj.root, "train@clip")
    data = (proj / LAST).read_bytes()
    (proj / LAST).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        inprocess(proj, "train@clip", "--run", "clip", "--method", "clip")
    assert LAST in str(err.value) and "truncated" in str(err.value)

    full = proj / "weights.pt"                        # torch weights for `model.pretrained`, cut short
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, full)
    full.write_bytes(full.read_bytes()[:400])
    proj.set_params(model={"pretrained": str(full)})
    with pytest.raises(InputError) as err:
        inprocess(proj, "pretrain")
    assert str(full) in str(err.value) and "truncated" in str(err.value)

    base = proj / "models/base/open_clip_model.safetensors"   # the exported base model, cut short
    base.write_bytes(base.read_bytes()[:1000])
    (proj / LAST).unlink()
    with pytest.raises(InputError) as err:
        inprocess(proj, "train@clip", "--run", "clip", "--method", "clip")
    assert "models/base/open_clip_model.safetensors" in str(err.value) and "truncated" in str(err.value)
