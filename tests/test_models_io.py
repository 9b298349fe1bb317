"""Loading from every kind of `pretrained`, safe checkpoint reads, and the open_clip local-dir export."""
from __future__ import annotations

import copy
import json

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from clipfinetune.io import InputError
from clipfinetune.models import ClipModel, apply_lora, export_model, extend_context, load_model

CAPTIONS = ["a red circle", "a small blue square to the left of a large green triangle"]
LONG_CAPTION = " ".join(f"the shape number {i} is a red circle." for i in range(20))


class NotATensor:
    """Something a weights-only unpickler must refuse."""


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return load_model("cft-tiny-vit").eval()


@pytest.fixture(scope="module")
def exported(base, tmp_path_factory):
    return export_model(base, tmp_path_factory.mktemp("export") / "plain")


@pytest.fixture(scope="module")
def images():
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(3))


def _plain_open_clip_outputs(folder, images, texts):
    clip, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    clip.eval()
    with torch.no_grad():
        return (clip.encode_image(images, normalize=True), clip.encode_text(tokenizer(texts), normalize=True),
                clip, preprocess)


def _our_outputs(model, images, texts):
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(model.tokenize(texts))


def _assert_same(ours, theirs):
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)


def test_export_round_trips_through_plain_open_clip(base, images, exported):
    folder = exported
    config = json.loads((folder / "open_clip_config.json").read_text())
    assert set(config) == {"model_cfg", "preprocess_cfg"} and (folder / "open_clip_model.safetensors").is_file()
    assert config["preprocess_cfg"]["resize_mode"] == "squash" and config["model_cfg"]["quick_gelu"] is False
    theirs = _plain_open_clip_outputs(folder, images, CAPTIONS)
    _assert_same(_our_outputs(base, images, CAPTIONS), theirs)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 80, 3), dtype=np.uint8))
    torch.testing.assert_close(theirs[3](picture), base.transform(picture))     # the same squash resize


def test_stretched_model_exports_248_positions_that_plain_open_clip_loads(base, images, tmp_path):
    model = copy.deepcopy(base)
    extend_context(model, freeze_kept=True)
    with torch.no_grad():
        model.clip.parametrizations.positional_embedding.original.add_(0.01)
    folder = export_model(model, tmp_path / "long")
    texts = [LONG_CAPTION, "a red circle"]
    theirs = _plain_open_clip_outputs(folder, images, texts)
    assert theirs[2].context_length == 248
    _assert_same(_our_outputs(model, images, texts), theirs)


def test_lora_model_exports_merged_weights_that_plain_open_clip_loads(base, images, tmp_path):
    model = copy.deepcopy(base)
    apply_lora(model, rank=2, init="fsc_clip")
    folder = export_model(model, tmp_path / "lora")
    assert hasattr(model.clip.visual.conv1, "lora_A")          # exporting does not merge the caller's model
    _assert_same(_our_outputs(model, images, CAPTIONS), _plain_open_clip_outputs(folder, images, CAPTIONS))


def test_quick_gelu_survives_the_export(images, tmp_path):
    torch.manual_seed(1)
    clip = open_clip.create_model("cft-tiny-vit", force_quick_gelu=True).eval()
    model = ClipModel(clip, open_clip.get_model_config("cft-tiny-vit"), tokenizer_source="")
    folder = export_model(model, tmp_path / "quick")
    assert json.loads((folder / "open_clip_config.json").read_text())["model_cfg"]["quick_gelu"] is True
    _assert_same(_our_outputs(model, images, CAPTIONS), _plain_open_clip_outputs(folder, images, CAPTIONS))


def test_every_way_of_naming_exported_weights_loads_the_same_model(base, images, exported):
    folder = exported
    expected = _our_outputs(base, images, CAPTIONS)
    for name, pretrained in [(f"local-dir:{folder}", ""), (str(folder), ""), ("cft-tiny-vit", str(folder))]:
        _assert_same(_our_outputs(load_model(name, pretrained).eval(), images, CAPTIONS), expected)


def test_checkpoint_files_load_as_state_dicts(base, images, tmp_path):
    state = base.clip.state_dict()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "weights.safetensors"))
    torch.save({"model": {f"clip.{k}": v for k, v in state.items()}, "step": 7}, tmp_path / "train.pt")
    expected = _our_outputs(base, images, CAPTIONS)
    for file in ("weights.safetensors", "train.pt"):
        _assert_same(_our_outputs(load_model("cft-tiny-vit", str(tmp_path / file)).eval(), images, CAPTIONS),
                     expected)


def test_training_checkpoint_with_lora_and_kept_rows_loads_folded(base, images, tmp_path):
    model = copy.deepcopy(base)
    extend_context(model, freeze_kept=True)
    apply_lora(model, rank=2, init="fsc_clip")
    torch.save({"state_dict": model.clip.state_dict()}, tmp_path / "ckpt.pt")
    loaded = load_model("cft-tiny-vit", str(tmp_path / "ckpt.pt")).eval()
    assert loaded.context_length == 248
    texts = [LONG_CAPTION]
    _assert_same(_our_outputs(loaded, images, texts), _our_outputs(model, images, texts))


def test_checkpoint_with_a_pickle_payload_is_refused(base, tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": base.clip.state_dict(), "payload": NotATensor()}, path)
    with pytest.raises(InputError, match="weights_only"):
        load_model("cft-tiny-vit", str(path))


def test_unknown_names_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="neither a file"):
        load_model("cft-tiny-vit", str(tmp_path / "missing.pt"))
