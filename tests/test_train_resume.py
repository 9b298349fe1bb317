"""Checkpoints: exact resume, fingerprints, non-finite stops, and refusing bad files."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from test_train_support import TinyClipModel, ToySource, config

from clipfinetune.methods.clip import ClipMethod
from clipfinetune.train import (
    CheckpointError,
    Monitor,
    NonFiniteLossError,
    Trainer,
    fingerprint,
    load_checkpoint,
)
from clipfinetune.train.checkpoint import FORMAT, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]

torch.set_num_threads(1)

# 40 samples, micro-batches of 4, accum 2 -> 5 optimiser steps per epoch, 15 in all; checkpoints every 4 steps.
SETTINGS = {"epochs": 3, "batch_size": 8, "accum_steps": 2, "checkpoint_every": 4, "lr": 2e-3, "warmup": 3}


def run(tmp_path, name, crash_at=None, fp="run-a", workers=0):    # workers > 0: see the shard-loader test
    """(trainer, whether it resumed, the trained module), as the train stage runs it."""
    trainer = Trainer(ClipMethod(), TinyClipModel(seed=0), ToySource(n=40, batch_size=4, workers=workers,
                                                                       crash_at=crash_at),
                      config(**SETTINGS), checkpoint_dir=tmp_path / name / "ckpt", fingerprint=fp)
    resumed = trainer.resume()
    with Monitor(tmp_path / name / "live", trainer.total_steps, trainer.step, resumed) as monitor:
        return trainer, resumed, trainer.fit(monitor)


def loss_history(live_dir):
    with open(live_dir / "plots" / "metrics" / "loss.tsv") as f:
        return [(int(r["step"]), float(r["loss"])) for r in csv.DictReader(f, delimiter="\t")]


def test_interrupted_then_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(tmp_path):
    _, _, straight = run(tmp_path, "straight")
    # killed while loading micro-batch 5 of epoch 1 (optimiser step 8 of 15): the last checkpoint is step 4
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "resumed", crash_at=(1, 5))
    assert load_checkpoint(tmp_path / "resumed" / "ckpt" / "last.pt")["step"] == 4
    trainer, was_resumed, resumed = run(tmp_path, "resumed")
    assert was_resumed and trainer.step == 15
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    # the dvclive history is continuous: steps 1..15 once each, equal to the uninterrupted run's losses
    assert loss_history(tmp_path / "resumed" / "live") == loss_history(tmp_path / "straight" / "live")
    assert [s for s, _ in loss_history(tmp_path / "resumed" / "live")] == list(range(1, 16))


def test_resume_after_a_kill_mid_write_of_the_dvclive_files(tmp_path):
    # dvclive writes in place: a SIGKILL can leave metrics.json empty and a metric row or header cut short
    _, _, straight = run(tmp_path, "straight")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "resumed", crash_at=(1, 5))
    live = tmp_path / "resumed" / "live"
    (live / "metrics.json").write_text("")
    loss = live / "plots" / "metrics" / "loss.tsv"
    loss.write_text(loss.read_text() + "17321\t1")                  # a row cut inside its step field
    lr = live / "plots" / "metrics" / "lr.tsv"
    lr.write_text("timest")                                          # a file cut inside its header
    trainer, was_resumed, resumed = run(tmp_path, "resumed")
    assert was_resumed and trainer.step == 15
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    assert loss_history(live) == loss_history(tmp_path / "straight" / "live")
    with open(lr) as f:
        assert [int(r["step"]) for r in csv.DictReader(f, delimiter="\t")] == list(range(5, 16))
    assert json.loads((live / "metrics.json").read_text())["step"] == 15


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, "shared", crash_at=(1, 5), fp="params-before")
    _, was_resumed, changed = run(tmp_path, "shared", fp="params-after")
    assert not was_resumed
    _, _, fresh = run(tmp_path, "fresh", fp="params-after")
    for (name, a), (_, b) in zip(fresh.state_dict().items(), changed.state_dict().items()):
        assert torch.equal(a, b), name
    assert load_checkpoint(tmp_path / "shared" / "ckpt" / "last.pt")["fingerprint"] == "params-after"


def test_fingerprint_follows_params_and_input_content():
    inputs = {"data/shards": "3f2a.dir", "clipfinetune/losses/clip.py": "9c1e"}
    fp = fingerprint("train@clip", {"train": {"lr": 1e-4}}, inputs)
    assert fp == fingerprint("train@clip", {"train": {"lr": 1e-4}}, dict(reversed(inputs.items())))
    assert fp != fingerprint("train@clip", {"train": {"lr": 2e-4}}, inputs)
    assert fp != fingerprint("train@goal", {"train": {"lr": 1e-4}}, inputs)
    assert fp != fingerprint("train@clip", {"train": {"lr": 1e-4}}, inputs, world_size=2)
    assert fp != fingerprint("train@clip", {"train": {"lr": 1e-4}}, {**inputs, "data/shards": "77b0.dir"})


def test_the_stages_inputs_are_content_digests_not_mtimes(tmp_path, monkeypatch):
    """stages/_common.py stage_inputs: each dvc.yaml dep of the stage (a `${...}` from params.yaml resolved) by its
    content: touching a file (a checkout rewriting it unchanged) keeps it, an edit changes it, and so does an edit,
    an added file or a rename inside a folder dep; an absent dep is "missing"; params.yaml is left to the params."""
    import os

    from stages import _common

    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "x.bin").write_bytes(b"x")
    (tmp_path / "params.yaml").write_text("inputs: {text: a.txt}\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: cat a.txt\n    deps:\n"
                                       + "".join(f"      - {d}\n" for d in ("${inputs.text}", "folder", "absent.txt",
                                                                          "params.yaml")))
    monkeypatch.setattr(_common, "ROOT", tmp_path)
    inputs = lambda: _common.stage_inputs("s")

    first = inputs()
    assert sorted(first) == ["a.txt", "absent.txt", "folder"] and first["absent.txt"] == "missing"
    os.utime(tmp_path / "a.txt", ns=(1, 1))
    os.utime(tmp_path / "folder" / "x.bin", ns=(1, 1))
    assert inputs() == first
    (tmp_path / "a.txt").write_text("two")
    second = inputs()
    assert second["a.txt"] != first["a.txt"] and second["folder"] == first["folder"]
    (tmp_path / "a.txt").write_text("one")
    assert inputs() == first                                       # the content, not the file's history
    seen = {first["folder"]}
    for change in (lambda f: (f / "x.bin").write_bytes(b"y"), lambda f: (f / "y.bin").write_bytes(b"y"),
                   lambda f: (f / "x.bin").rename(f / "z.bin")):
        change(tmp_path / "folder")
        assert inputs()["folder"] not in seen
        seen.add(inputs()["folder"])


class NaNAtStep3(ClipMethod):
    def loss(self):
        base = super().loss()

        class Loss(torch.nn.Module):
            calls = 0

            def forward(self, features):
                Loss.calls += 1
                terms = base(features)
                scale = float("nan") if Loss.calls == 3 else 0.0
                return {**terms, "boom": terms["contrastive"] * scale}
        return Loss()


@pytest.mark.parametrize("log_every,precision", [(1, "fp32"), (4, "fp32"), (100, "fp32"), (4, "fp16")])
def test_non_finite_loss_stops_naming_step_and_term_and_keeps_the_last_good_checkpoint(tmp_path, log_every,
                                                                                       precision):
    """The check reads the values every `log_every` steps and before each checkpoint: the bad step 3 is found at
    step 3 (log_every 1), 4 (its block) or at the checkpoint of step 4; the optimiser skipped step 3 and every later
    one on the device, so the weights are step 2's, and no checkpoint was written after it (fp16: with the
    GradScaler's own skip in the same step)."""
    trainer = Trainer(NaNAtStep3(), TinyClipModel(), ToySource(n=40, batch_size=8),
                      config(epochs=2, checkpoint_every=2, log_every=log_every, precision=precision),
                      checkpoint_dir=tmp_path / "ckpt", fingerprint="x")
    if precision == "fp16":
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)   # this toy's scaled gradients fit fp16
    logged = []

    class Steps:
        def log(self, step, scalars):
            logged.append(step)

    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit(Steps())
    message = str(err.value)
    assert "optimiser step 3" in message and "'boom'" in message and "last.pt (step 2)" in message
    assert logged == [1, 2]                                      # the good steps only
    ckpt = load_checkpoint(tmp_path / "ckpt" / "last.pt")
    assert ckpt["step"] == 2
    for name, value in trainer.module.state_dict().items():      # weights untouched from the failed step on
        assert torch.equal(ckpt["model"][name], value), name
        assert torch.isfinite(value).all()
    for state in trainer.optimizer.state.values():               # AdamW's moments and step counters too
        assert torch.isfinite(state["exp_avg"]).all() and state["step"].item() == 2


class Payload:
    def __reduce__(self):
        return (print, ("arbitrary code ran",))


def test_a_checkpoint_with_a_pickle_payload_is_refused(tmp_path):
    path = tmp_path / "ckpt" / "last.pt"
    path.parent.mkdir()
    torch.save({"format": FORMAT, "step": 1, "payload": Payload()}, path)
    with pytest.raises(CheckpointError, match="refused") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)
    trainer = Trainer(ClipMethod(), TinyClipModel(), ToySource(), config(), checkpoint_dir=path.parent)
    with pytest.raises(CheckpointError, match="refused"):
        trainer.resume()


def test_the_trainer_resumes_only_when_asked(tmp_path):
    """Constructing a Trainer reads no checkpoint; `resume()` does, once, before `fit`."""
    run(tmp_path, "done")
    trainer = Trainer(ClipMethod(), TinyClipModel(seed=0), ToySource(n=40, batch_size=4), config(**SETTINGS),
                      checkpoint_dir=tmp_path / "done" / "ckpt", fingerprint="run-a")
    assert trainer.step == 0
    assert trainer.resume() and trainer.step == 15
    with pytest.raises(RuntimeError, match="before fit"):
        trainer.resume()


def test_a_truncated_checkpoint_gives_a_clear_error_naming_the_file(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(path, {"step": 3, "model": TinyClipModel().state_dict()})
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value)


# ------------------------------------------------------------------------------------------ with the real loader
def _write_shards(root, n=24, per_shard=12):
    import io
    import json as _json

    import webdataset as wds
    from PIL import Image

    from clipfinetune.data.prepare.shards import write_index

    root.mkdir()
    for s in range(n // per_shard):
        with wds.TarWriter(str(root / f"train-{s:06d}.tar")) as sink:
            for i in range(s * per_shard, (s + 1) * per_shard):
                jpg = io.BytesIO()
                Image.new("RGB", (16, 16), ((37 * i) % 256, (91 * i) % 256, 128)).save(jpg, format="JPEG")
                caps = [f"{i} {c}" for c in range(3)]
                record = {"image_id": str(i), "source": "coco", "width": 16, "height": 16, "captions": caps,
                          "long_caption": "", "word_regions": [], "sentences": [], "local_pair": [], "negatives": []}
                sink.write({"__key__": f"coco_{i}", "jpg": jpg.getvalue(), "txt": caps[0],
                            "json": _json.dumps(record).encode()})
    write_index(root)


class _Crashing:
    """A BatchSource wrapper that dies at (epoch, micro-batch), as a killed process would."""

    def __init__(self, source, crash_at):
        self.source, self.crash_at = source, crash_at

    def epoch_length(self, epoch):
        return self.source.epoch_length(epoch)

    def batches(self, epoch, start=0):
        for i, batch in enumerate(self.source.batches(epoch, start), start=start):
            if (epoch, i) == self.crash_at:
                raise KeyboardInterrupt
            yield batch


def test_resume_with_the_shard_loader_and_workers_matches_an_uninterrupted_run(tmp_path):
    from test_train_support import CONTEXT, SIZE, VOCAB

    from clipfinetune.data.loader import ExampleContext, ShardLoader

    _write_shards(tmp_path / "shards")

    def transform(pil):
        return torch.from_numpy(
            __import__("numpy").asarray(pil.resize((SIZE, SIZE)), dtype="float32") / 255).permute(2, 0, 1)

    def tokenize(texts):
        out = torch.zeros(len(texts), CONTEXT, dtype=torch.long)
        for row, t in enumerate(texts):
            i, c = map(int, t.split())
            out[row, :3] = torch.tensor([1 + i % (VOCAB - 2), 1 + c, VOCAB - 1])
        return out

    ctx = ExampleContext(transform, tokenize, SIZE)

    def trainer(name, crash_at=None, batch=4, epochs=2, every=4):
        loader = ShardLoader(tmp_path / "shards", "train", ClipMethod(), ctx, batch_size=batch, seed=0, num_workers=2)
        source = _Crashing(loader, crash_at) if crash_at else loader
        made = Trainer(ClipMethod(), TinyClipModel(seed=0), source,
                       config(epochs=epochs, batch_size=batch, checkpoint_every=every, lr=2e-3),
                       checkpoint_dir=tmp_path / name, fingerprint="shards")
        return made, made.resume()

    straight = trainer("straight")[0].fit()
    with pytest.raises(KeyboardInterrupt):
        trainer("resumed", crash_at=(0, 5))[0].fit()              # 6 steps per epoch; last checkpoint: step 4
    again, resumed_it = trainer("resumed")
    assert resumed_it and again.step == 4
    resumed = again.fit()
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name

    # 24 images, batch 7: one stream of passes cut into batches, so epochs of ceil(24 e / 7) steps: 4, 3, 4
    odd = {"batch": 7, "epochs": 3, "every": 2}
    straight = trainer("odd-straight", **odd)[0]
    assert straight.epoch_steps == [4, 3, 4] and straight.total_steps == 11
    straight = straight.fit()
    with pytest.raises(KeyboardInterrupt):
        trainer("odd", crash_at=(1, 2), **odd)[0].fit()           # the third step of epoch 1 (step 7)
    again, resumed_it = trainer("odd", **odd)
    assert resumed_it and again.step == 6 and again.epoch_position(6) == (1, 2)
    resumed = again.fit()
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
