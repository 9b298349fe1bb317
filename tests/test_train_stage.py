"""Stage wiring of `run_settings` -> `train@<run>` (each run's settings file) and the `pretrain` caption source."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from stages import _common
from stages import pretrain as pretrain_stage
from stages import run_settings as run_settings_stage
from stages import train as stage

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
StageParams = _common.StageParams


PARAMS = {"loss": {"lambda_g": 0.5, "lambda_l": 0.5, "focal_gamma": 2.0, "label_smoothing": 0.02},
          "runs": {"clip": {"method": "clip"}, "fsc_lhn_only": {"method": "fsc_clip", "lambda_g": 0.0}},
          "train": {"epochs": 2, "batch_size": 8, "lr": 1e-4, "keep_checkpoint": False, "fsc_clip": {"lr": 5e-6}},
          "model": {"precision": "fp32"}}


def _run_settings_stage(tmp_path, monkeypatch, values) -> dict[str, bytes]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_common, "stage_params", lambda name=None: StageParams("run_settings", values))
    monkeypatch.setattr(sys, "argv", ["stages/run_settings.py", "--stage", "run_settings"])
    run_settings_stage.main()                                      # fails if a declared key is never read
    return {p.name: p.read_bytes() for p in sorted((tmp_path / "data" / "runs").iterdir())}


def test_run_settings_writes_each_runs_resolved_settings_as_stable_bytes(tmp_path, monkeypatch):
    """One file per run, sorted keys: a run whose settings do not change keeps its bytes (DVC re-trains nothing)."""
    files = _run_settings_stage(tmp_path, monkeypatch, PARAMS)
    assert sorted(files) == ["clip.json", "fsc_lhn_only.json"]
    lhn = json.loads(files["fsc_lhn_only.json"])
    code = lhn.pop("code")                                         # the method's code digest: the run's code dep
    assert list(code) == ["fsc_clip"] and len(code["fsc_clip"]) == 32
    assert lhn == {"method": "fsc_clip", "precision": "fp32",
                   "config": {"lambda_g": 0.0, "lambda_l": 0.5, "focal_gamma": 2.0, "label_smoothing": 0.02},
                   "train": {"epochs": 2, "batch_size": 8, "lr": 5e-6}}
    assert list(json.loads(files["clip.json"])) == sorted(json.loads(files["clip.json"]))
    swept = _run_settings_stage(tmp_path, monkeypatch, {**PARAMS, "loss": {**PARAMS["loss"], "lambda_l": 0.2}})
    assert swept["clip.json"] == files["clip.json"] and swept["fsc_lhn_only.json"] != files["fsc_lhn_only.json"]


def test_run_settings_names_an_unknown_key_and_writes_nothing(tmp_path, monkeypatch):
    bad = {**PARAMS, "runs": {"clip": {"method": "clip", "lambda_l": 0.2}}}
    with pytest.raises(SystemExit, match=r"stage run_settings: params runs\.clip\.lambda_l"):
        _run_settings_stage(tmp_path, monkeypatch, bad)
    assert not (tmp_path / "data" / "runs").exists()


def test_train_reads_its_runs_file_and_names_the_stage_that_writes_it(tmp_path, monkeypatch):
    monkeypatch.setattr(stage, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match=r"data/runs/clip\.json does not exist: run `dvc repro run_settings`"):
        stage.run_settings("clip", "clip")
    (tmp_path / "data" / "runs").mkdir(parents=True)
    (tmp_path / "data" / "runs" / "x.json").write_text(json.dumps({"method": "goal", "config": {}}))
    with pytest.raises(SystemExit, match="method 'goal', not 'clip'"):
        stage.run_settings("x", "clip")
    assert stage.run_settings("x", "goal") == {"method": "goal", "config": {}}


# ------------------------------------------------------------------------------------------ pretrain source
def _tiny_coco(tmp_path, n_images=6, captions_per_image=5):
    from PIL import Image

    (tmp_path / "images").mkdir()
    images, annotations = [], []
    for i in range(n_images):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / "images" / f"{i}.jpg")
        images.append({"id": i, "file_name": f"{i}.jpg", "width": 8, "height": 8})
        annotations += [{"id": 100 * i + c, "image_id": i, "caption": f"image {i} caption {c}"}
                        for c in range(captions_per_image)]
    (tmp_path / "captions.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    from clipfinetune.data.readers import coco

    return coco.read(tmp_path / "captions.json", tmp_path / "images")


def _transform(pil):
    return torch.tensor([float(pil.getpixel((0, 0))[0])])


def _tokenize(texts):          # "image I caption C" -> [I, C]
    return torch.tensor([[int(t.split()[1]), int(t.split()[3])] for t in texts])


def test_caption_source_shows_each_image_once_per_epoch_with_a_caption_redrawn_each_epoch(tmp_path):
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    records = _tiny_coco(tmp_path)
    source = CaptionPairSource(records, _transform, _tokenize, batch_size=2, seed=3)
    assert len(source) == 3
    epochs = [[b["text"] for b in source.batches(e)] for e in range(4)]
    for batches in epochs:
        pairs = torch.cat(batches)
        assert sorted(pairs[:, 0].tolist()) == list(range(6))      # every image once
    picks = {tuple(torch.cat(b)[torch.cat(b)[:, 0].argsort(), 1].tolist()) for b in epochs}
    assert len(picks) > 1                                          # captions differ between epochs
    again = [b["text"] for b in source.batches(1, start=1)]        # resume inside an epoch
    assert all(torch.equal(a, b) for a, b in zip(again, epochs[1][1:])) and len(again) == 2


def test_caption_source_splits_each_global_batch_between_ranks(tmp_path):
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    records = _tiny_coco(tmp_path)
    ranks = [CaptionPairSource(records, _transform, _tokenize, batch_size=1, seed=3, rank=r, world_size=2)
             for r in range(2)]
    single = CaptionPairSource(records, _transform, _tokenize, batch_size=2, seed=3)
    for a, b, whole in zip(ranks[0].batches(0), ranks[1].batches(0), single.batches(0)):
        assert torch.equal(torch.cat([a["text"], b["text"]]), whole["text"])


def _coloured_coco(tmp_path, colours=("red", "blue", "green"), per_colour=8):
    """Images 0.. with a `colour` group and `labels` in images[]; image i's caption is 'image i caption c'."""
    from PIL import Image

    (tmp_path / "images").mkdir()
    images, annotations = [], []
    for i in range(len(colours) * per_colour):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(tmp_path / "images" / f"{i}.png")
        colour = colours[i % len(colours)]
        images.append({"id": i, "file_name": f"{i}.png", "width": 8, "height": 8, "colour": colour,
                       "labels": [colour, "star" if i % 2 else "ring"]})
        annotations += [{"id": 100 * i + c, "image_id": i, "caption": f"image {i} caption {c}"} for c in range(2)]
    (tmp_path / "captions.json").write_text(json.dumps({"images": images, "annotations": annotations}))
    return tmp_path / "captions.json", tmp_path / "images", {i: colours[i % len(colours)] for i in range(len(images))}


def _records(captions, images):
    from clipfinetune.data.readers import coco

    return coco.read(captions, images)


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_caption_source_opens_every_batch_with_its_share_of_one_colour(tmp_path, share):
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    captions, images, colour_of = _coloured_coco(tmp_path)
    source = CaptionPairSource(_records(captions, images), _transform, _tokenize, batch_size=8, seed=1,
                               group_key="colour", group_share=share)
    assert len(source) == 3
    for epoch in range(3):
        used = []
        batch_colours = []
        for batch in source.batches(epoch):
            ids = batch["text"][:, 0].tolist()
            counts = {c: sum(colour_of[i] == c for i in ids) for c in set(colour_of.values())}
            top = max(counts, key=counts.get)
            assert counts[top] >= share * 8                  # the one-colour part (mixed images may add more)
            batch_colours.append(top)
            used += ids
        if share < 1.0:
            assert len(set(used)) == len(used)               # no image twice in an epoch
        assert len(set(batch_colours)) == 3                  # a new colour each batch (3 batches, balanced)
    again = [b["text"] for b in source.batches(2)]           # a function of (seed, epoch)
    assert all(torch.equal(a, b) for a, b in zip(again, [b["text"] for b in source.batches(2)]))


def test_caption_source_without_a_share_is_the_plain_shuffle_and_labels_are_multi_hot(tmp_path):
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    captions, images, _ = _coloured_coco(tmp_path)
    plain = CaptionPairSource(_records(captions, images), _transform, _tokenize, batch_size=8, seed=1)
    zero = CaptionPairSource(_records(captions, images), _transform, _tokenize, batch_size=8, seed=1,
                             group_key="colour",
                             group_share=0.0, label_key="labels")
    assert all(torch.equal(a["text"], b["text"]) for a, b in zip(plain.batches(0), zero.batches(0)))
    assert zero.label_names == ["blue", "green", "red", "ring", "star"]
    row = zero.labels[zero.image_ids.index("4")]                 # image 4: blue (4 % 3 = 1), ring (even)
    assert row.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        # no group key
        CaptionPairSource(_records(captions, images), _transform, _tokenize, batch_size=8, group_share=0.5)


def test_caption_source_names_the_image_without_a_group(tmp_path):
    from clipfinetune.io import InputError
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    captions, images, _ = _coloured_coco(tmp_path)
    coco = json.loads(captions.read_text())
    del coco["images"][5]["colour"]
    captions.write_text(json.dumps(coco))
    with pytest.raises(InputError, match="colour"):
        CaptionPairSource(_records(captions, images), _transform, _tokenize, batch_size=8, group_key="colour",
                          group_share=0.5)


def _tokenize_any(texts):      # "image I caption C" -> [I, C]; an object name -> [-1, its length]
    return torch.tensor([[int(t.split()[1]), int(t.split()[3])] if t.startswith("image ") else [-1, len(t)]
                         for t in texts])


def test_caption_source_maps_region_boxes_to_model_input_and_serves_them_with_each_batch(tmp_path):
    from torchvision import transforms as T

    from clipfinetune.io import InputError
    from clipfinetune.sample.pretrain.sources import CaptionPairSource

    captions, images, _ = _coloured_coco(tmp_path)
    coco = json.loads(captions.read_text())
    for image in coco["images"]:                    # 8 x 8 images; one region in the top-left quarter
        image["regions"] = [{"box": [0, 0, 4, 4], "labels": list(image["labels"]), "text": " ".join(image["labels"])}]
    coco["images"][4]["regions"].append({"box": [4, 2, 8, 6], "labels": ["green"], "text": "a green"})
    captions.write_text(json.dumps(coco))
    to_16 = T.Compose([T.Resize((16, 16)), T.ToTensor()])          # input pixels = 2 x image pixels
    source = CaptionPairSource(_records(captions, images), to_16, _tokenize_any, batch_size=8, label_key="labels",
                               region_key="regions")
    four = source.image_ids.index("4")
    boxes, rows = source.regions[four]
    assert boxes.tolist() == [[0.0, 0.0, 8.0, 8.0], [8.0, 4.0, 16.0, 12.0]]
    assert source.label_names == ["blue", "green", "red", "ring", "star"]
    assert rows.tolist() == [[1.0, 0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]]     # image 4: blue ring; + green
    assert [source.region_texts[c] for c in source.region_classes[four]] == ["blue ring", "a green"]
    assert source.region_tokens[four].tolist() == [[-1, 9], [-1, 7]]
    for batch in source.batches(0):                 # every object of the batch, on its image's batch row
        ids = batch["text"][:, 0].tolist()
        expected = [(row, source.regions[source.image_ids.index(str(i))][0][k].tolist())
                    for row, i in enumerate(ids) for k in range(len(source.regions[source.image_ids.index(str(i))][0]))]
        assert [(int(b[0]), b[1:].tolist()) for b in batch["region_boxes"]] == expected
        assert len(batch["region_text"]) == len(batch["region_class"]) == len(expected)
    # an object label that no image-level label row holds (labels come from one-object images only) gets a column
    coco["images"][4]["regions"].append({"box": [0, 4, 4, 8], "labels": ["cross", "red"], "text": "a red cross"})
    captions.write_text(json.dumps(coco))
    source = CaptionPairSource(_records(captions, images), to_16, _tokenize_any, batch_size=8, label_key="labels",
                               region_key="regions")
    assert source.label_names == ["blue", "cross", "green", "red", "ring", "star"]
    assert source.regions[four][1][2].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert source.labels[:, 1].sum() == 0                                  # no image-level row names it
    del coco["images"][5]["regions"]
    captions.write_text(json.dumps(coco))
    with pytest.raises(InputError, match="regions"):
        CaptionPairSource(_records(captions, images), to_16, _tokenize_any, batch_size=8, label_key="labels",
                          region_key="regions")


def test_pretrain_features_embed_each_object_name_once_and_pool_each_box():
    from clipfinetune.models import load_model
    from clipfinetune.sample.pretrain.method import PretrainMethod

    torch.manual_seed(0)
    model = load_model("cft-tiny-vit")
    module = PretrainMethod(1.0).build(model).eval()
    names = model.tokenize(["a red circle", "a blue star"])
    batch = {"image": torch.randn(2, 3, 64, 64), "text": model.tokenize(["x", "y"]),
             "region_boxes": torch.tensor([[0, 4.0, 4, 30, 30], [1, 10, 10, 40, 40], [1, 40, 40, 60, 60]]),
             "region_text": names[[0, 1, 0]], "region_class": torch.tensor([0, 1, 0])}
    with torch.no_grad():
        f = module(batch)
        boxes = [torch.tensor([[4.0, 4, 30, 30]]), torch.tensor([[10.0, 10, 40, 40], [40, 40, 60, 60]])]
        assert torch.allclose(f["region"], model.region_features(batch["image"], boxes), atol=1e-6)
        assert torch.allclose(f["image"], model.encode_image(batch["image"]), atol=1e-6)
        assert torch.allclose(f["region_text"], model.encode_text(names[[0, 1, 0]], normalize=True), atol=1e-6)
    terms = PretrainMethod(1.0).loss()(f)
    assert set(terms) == {"contrastive", "region_text"} and all(torch.isfinite(v) for v in terms.values())


# ------------------------------------------------------------------------------------------ pretrain, real weights
def test_pretrain_with_given_weights_exports_them_unchanged_and_leaves_only_its_note(tmp_path, monkeypatch):
    """`model.pretrained: local-dir:<folder>` (the real profile's stand-in for ViT-B-16/openai): models/base is
    that folder's weights, nothing trains, and dvclive/pretrain holds only skipped.json (no stale curves)."""
    from safetensors.torch import load_file

    from clipfinetune.models import export_model, load_model

    pretrain = pretrain_stage
    monkeypatch.setattr(pretrain, "ROOT", tmp_path)                 # never the repository's models/base
    export_model(load_model("cft-tiny-vit"), tmp_path / "weights")
    stale = tmp_path / "dvclive" / "pretrain" / "plots" / "metrics" / "loss.tsv"
    stale.parent.mkdir(parents=True)
    stale.write_text("step\tloss\n0\t4.2\n")
    params = StageParams("pretrain", {
        "sources": {"coco": {"reader": "coco", "captions": "absent.json", "images": "absent"}},
        "model": {"name": "ViT-B-16", "pretrained": f"local-dir:{tmp_path / 'weights'}", "quick_gelu": "auto",
                  "precision": "bf16"},
        "pretrain": {"epochs": 1, "batch_size": 2, "lr": 1e-3, "warmup": 1, "wd": 0.1, "grad_clip": 1.0,
                     "checkpoint_every": 0, "seed": 0, "sources": ["coco"]}})
    monkeypatch.setattr(_common, "stage_params", lambda name=None: params)
    monkeypatch.setattr(sys, "argv", ["stages/pretrain.py", "--stage", "pretrain"])
    pretrain.main()
    given = load_file(tmp_path / "weights" / "open_clip_model.safetensors")
    base = load_file(tmp_path / "models" / "base" / "open_clip_model.safetensors")
    assert given.keys() == base.keys() and all(given[k].equal(base[k]) for k in given)
    live = tmp_path / "dvclive" / "pretrain"
    assert [p.name for p in live.iterdir()] == ["skipped.json"]
    assert json.loads((live / "skipped.json").read_text())["pretrained"] == f"local-dir:{tmp_path / 'weights'}"
