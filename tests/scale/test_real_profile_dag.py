"""The real-data profile end to end: params.real.yaml applied as a user would, on a miniature tree in the real
layouts (docs/evalsets.md §8, tests/fixtures/real_tree.py), through `dvc repro eval@clip`, in a throw-away copy.

Only compute is scaled down: one epoch, tiny batches, no loader workers (tests/conftest.py), a tiny exported CLIP
standing in for the pretrained weights (`model.pretrained: local-dir:...`, also the LISM matcher), no SAM checkpoint
(the documented CPU segmenter), and a fake OpenAI-compatible server in a thread in place of vLLM. Everything else
(paths, layouts, spaCy lemmatizer, server backend, bf16 precision, the benchmark sets) is the real profile's.
Minutes on 2 CPU cores: tests/scale/, run by `make test-scale`.
"""
from __future__ import annotations

import json
import time

import pytest
from fixtures import real_tree
from fixtures.llm import LLM, openai_server, rewrite_reply
from fixtures.project import RAN, copy_project, write_params
from fixtures.project import run as _run

pytestmark = pytest.mark.dag

WEIGHTS = "datasets/weights/clip-tiny"          # the stand-in for ViT-B-16/openai (and LISM's ViT-L-14-336)
# the compute overrides of a CPU test; nothing here is a path or a layout
CPU = {
    "model": {"pretrained": f"local-dir:{WEIGHTS}"},
    "lism": {"model": WEIGHTS, "pretrained": "", "batch_size": 32},
    "segments": {"sam_checkpoint": ""},          # no SAM: the CPU segmenter, noted by validate and in the metadata
    "negatives": {"concurrency": 2, "timeout": 20, "max_retries": 1, "backoff": 0.1},
    "shards": {"maxcount": 4},
    "train": {"epochs": 1, "batch_size": 2, "warmup": 1, "checkpoint_every": 0},
    "eval": {"batch_size": 64},
}
STAGES = {"plan@repro", "word_regions@coco", "sentences@docci", "segments@docci", "pretrain", "lism@docci",
          "negatives@coco",
          "shards", "code", "run_settings", "train@clip", "evalsets", "eval@clip"}


def _json(path):
    return json.loads(path.read_text())


def _keys(node) -> set:
    return set(node) | set().union(*map(_keys, node.values())) if isinstance(node, dict) else set()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    import torch

    from clipfinetune.models import export_model, load_model

    repo = copy_project(tmp_path_factory.mktemp("real") / "project")
    counts = real_tree.build(repo)
    torch.manual_seed(0)
    export_model(load_model("cft-tiny-vit"), repo / WEIGHTS)
    rec = {"repo": repo, "counts": counts}
    with openai_server(rewrite_reply(real_tree.NOUNS, real_tree.ADJECTIVES)) as (base_url, received):
        applied = _run(repo, "python", "-m", "clipfinetune.project.profile", "apply", "params.real.yaml")
        rec["applied"] = applied.stdout
        write_params(repo, {**CPU, "negatives": {**CPU["negatives"], "base_url": base_url}})
        _run(repo, "git", "init", "-q")
        _run(repo, "git", "add", "-A")
        _run(repo, "git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "real-data profile")
        rec["validate"] = _run(repo, "python", "-m", "clipfinetune.project.validate", check=False)
        if rec["validate"].returncode:
            pytest.fail(f"validate failed:\n{rec['validate'].stdout}")
        t0 = time.perf_counter()
        proc = _run(repo, "dvc", "repro", "eval@clip")
        rec["seconds"] = time.perf_counter() - t0
        rec["base_url"], rec["requests"] = base_url, list(received)
    rec["ran"], rec["log"] = RAN.findall(proc.stdout), proc.stdout + proc.stderr
    print(f"\n[real profile] dvc repro eval@clip: {rec['seconds']:.0f}s, {len(rec['requests'])} LLM requests")
    return rec


def test_the_profile_applies_and_validates_with_only_the_cpu_fallback_noted(real):
    assert "model.name" in real["applied"] and "negatives.backend" in real["applied"]
    out = real["validate"].stdout
    assert "0 missing" in out and "MISSING" not in out
    assert "note  segments.sam_checkpoint" in out


def test_repro_eval_clip_runs_exactly_the_stages_it_needs(real):
    assert set(real["ran"]) == STAGES, real["ran"]
    repo = real["repo"]
    skipped = _json(repo / "dvclive" / "pretrain" / "skipped.json")      # real weights: nothing pretrained
    assert skipped["pretrained"] == f"local-dir:{WEIGHTS}"
    assert not (repo / "checkpoints" / "pretrain").exists()
    assert [p.name for p in (repo / "dvclive" / "pretrain").iterdir()] == ["skipped.json"]
    assert "precision bf16: bf16 autocast on cpu" in real["log"]          # the recipes' bf16, on CPU too


def test_the_base_model_is_the_given_weights_unchanged(real):
    from safetensors.torch import load_file

    repo = real["repo"]
    given = load_file(repo / WEIGHTS / "open_clip_model.safetensors")
    base = load_file(repo / "models" / "base" / "open_clip_model.safetensors")
    assert given.keys() == base.keys()
    assert all(given[k].equal(base[k]) for k in given)


def test_data_stages_read_the_real_layouts(real):
    prepared, counts = real["repo"] / "data" / "prepared", real["counts"]
    words = _json(prepared / "word_regions.meta.json")
    assert words["captions"] == counts["coco_train_captions"] and words["rows"] > 0
    sentences = _json(prepared / "sentences.meta.json")
    assert sentences["records"] == len(real_tree.DOCCI) and sentences["rows"] > len(real_tree.DOCCI)
    segments = _json(prepared / "segments.meta.json")
    assert "CPU" in segments["segmenter"] and "felzenszwalb" in segments["segmenter"]
    assert segments["n_images"] == len(real_tree.DOCCI) and segments["n_segments"] > 0 and not segments["skipped"]
    lism = _json(prepared / "local_pairs.meta.json")
    assert (lism["n_train_images"], lism["n_test_images"]) == (counts["docci_train"], counts["docci_test"])
    assert lism["other_splits"] == {"qual_dev": 1, "qual_test": 1} and not lism["skipped"]
    assert _json(real["repo"] / "metrics" / "lism.json")["lism"]["n_images"] == counts["docci_train"]   # no truth
    test_list = _json(real["repo"] / "data" / "evalsets" / "global_local" / "test.json")
    assert len(test_list) == 2 * counts["docci_test"]
    shards = _json(real["repo"] / "data" / "shards" / "meta.json")
    assert shards["samples_train"] + shards["samples_val"] == counts["coco_train_images"] + counts["docci_train"]
    assert shards["images_skipped_missing"] == shards["images_skipped_corrupt"] == 0


def test_negatives_came_from_the_server_backend(real):
    meta = _json(real["repo"] / "data" / "prepared" / "negatives.meta.json")
    assert meta["backend"] == "server" and meta["endpoint"] == real["base_url"] + "/chat/completions"
    assert meta["captions"] == real["counts"]["coco_train_captions"] and meta["rows"] > 0
    assert meta["requests_asked"] == len(real["requests"]) > 0
    assert {r["model"] for r in real["requests"]} == {LLM}
    assert all(r["response_format"]["type"] == "json_schema" for r in real["requests"])


def test_eval_scores_every_populated_real_set_and_notes_the_rest(real):
    metrics = _json(real["repo"] / "metrics" / "clip.json")
    assert metrics["meta"]["model"] == "clip"

    def numbers(node, keys):
        assert all(isinstance(node[k], float) and 0 <= node[k] <= 100 for k in keys), node
    recall = [f"{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)]
    numbers(metrics["retrieval"]["real"], recall)
    numbers(metrics["retrieval"]["flickr1k"], recall)
    for name in ("real", "dci", "urban1k"):
        numbers(metrics["long_retrieval"][name], [f"{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5)])
    numbers(metrics["global_local"]["real"], ["i2t_map10", "t2i_map10"])
    numbers(metrics["box_cls"]["real"], ["top1", "top5", "macc1", "macc5"])
    numbers(metrics["compositionality"]["sugarcrepe"]["real"], list(real_tree.SUGARCREPE) + ["mean"])
    numbers(metrics["compositionality"]["aro"]["real"], ["vg_relation", "vg_attribution", "coco_order"])
    assert "sample" not in _keys(metrics)                                # no sample-world set on a real model
    for task in ("valse", "winoground"):                                 # unset in both profiles
        assert metrics["skipped"][task] == "not configured"


def test_the_trained_model_is_an_open_clip_export_that_loads(real):
    import open_clip
    import torch
    from PIL import Image

    folder = real["repo"] / "models" / "clip"
    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    image = preprocess(Image.open(real["repo"] / "datasets" / "coco" / "val2017" / "000000000139.jpg"))
    with torch.no_grad():
        img = model.encode_image(image[None])
        txt = model.encode_text(tokenizer(["a brown dog next to a grey cat"]))
    assert img.shape == txt.shape and torch.isfinite(img).all() and torch.isfinite(txt).all()
    base = open_clip.create_model(f"local-dir:{real['repo'] / 'models' / 'base'}")
    assert any(not torch.equal(p, q) for p, q in zip(model.state_dict().values(), base.state_dict().values()))


def _train_records(repo):
    import tarfile

    for path in sorted((repo / "data" / "shards").glob("train-*.tar")):
        with tarfile.open(path) as tf:
            for member in tf:
                if member.name.endswith(".json"):
                    yield json.loads(tf.extractfile(member).read())


# the papers' epoch units counted from the shard records: DeGLA's captions (those the negatives stage rewrote),
# HarmoCLIP's word-region rows
UNITS = {"degla": lambda r: len({e["caption_index"] for e in r.get("negatives") or [] if e["texts"]}),
         "harmoclip": lambda r: len(r.get("word_regions") or []) if r.get("captions") else 0}


class _Interrupted:
    """A batch source killed (KeyboardInterrupt) when it reaches micro-batch `at` of an epoch."""

    def __init__(self, source, at):
        self.source, self.at = source, at

    def epoch_length(self, epoch):
        return self.source.epoch_length(epoch)

    def batches(self, epoch, start=0):
        for i, batch in enumerate(self.source.batches(epoch, start), start):
            if i == self.at:
                raise KeyboardInterrupt
            yield batch


def test_the_profile_trains_clip_over_its_captions(real):
    repo = real["repo"]
    data = _json(repo / "dvclive" / "train" / "clip" / "data.json")
    captions = sum(len(r["captions"]) for r in _train_records(repo) if r.get("captions"))
    assert (data["epoch_unit"], data["units"]) == ("caption", captions)
    assert data["batches_per_epoch"] == -(-captions // CPU["train"]["batch_size"]) > -(-data["wanted"] // 2)


@pytest.mark.parametrize("name", ["degla", "harmoclip"])
def test_method_epochs_take_their_units_steps_and_resume_mid_epoch(real, name, tmp_path):
    import math

    import torch
    import yaml

    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import get_method
    from clipfinetune.models import load_model
    from clipfinetune.train import TrainConfig, Trainer, load_checkpoint

    repo = real["repo"]
    epoch_unit = yaml.safe_load((repo / "params.yaml").read_text())["train"]["epoch_unit"]
    assert epoch_unit == "method"                               # what the real profile trains with
    units = sum(UNITS[name](r) for r in _train_records(repo) if r["source"] == "coco")
    images = sum(1 for r in _train_records(repo) if UNITS[name](r))
    assert units > images                                       # the unit, not the image, sets the epoch here
    cfg = TrainConfig(epochs=1, batch_size=2, lr=1e-4, warmup=1, checkpoint_every=2, seed=0, epoch_unit=epoch_unit)

    def train(run, interrupt_at=None):
        model = load_model(f"local-dir:{repo / 'models' / 'base'}")
        ctx = ExampleContext.of_model(model)
        source = ShardLoader(repo / "data" / "shards", "train", get_method(name)(), ctx, batch_size=2, seed=0,
                             epoch_unit=cfg.epoch_unit)
        if interrupt_at is not None:
            source = _Interrupted(source, interrupt_at)
        trainer = Trainer(get_method(name)(), model, source, cfg, checkpoint_dir=tmp_path / run, fingerprint=name)
        resumed = trainer.resume()
        return trainer, resumed, trainer.fit()

    trainer, _, straight = train("straight")
    assert trainer.epoch_steps == [trainer.step] == [math.ceil(units / 2)]
    with pytest.raises(KeyboardInterrupt):
        train("resumed", interrupt_at=trainer.step // 2 + 1)               # mid-epoch, after a checkpoint
    assert 0 < load_checkpoint(tmp_path / "resumed" / "last.pt")["step"] < trainer.step
    _, was_resumed, resumed = train("resumed")
    assert was_resumed
    for (key, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), key
