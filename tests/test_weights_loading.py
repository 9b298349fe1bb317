"""Real weights, loaded right (issue 33): the activation follows the weights (QuickGELU for OpenAI's), OpenAI's
TorchScript archives load through open_clip's own OpenAI loader, and an open_clip tag loads offline from a filled
Hugging Face cache. ViT-B-16's geometry with one block per tower (tests/fixtures/real_arch.py), random init.

References are plain open_clip models (built with the activation the weights are known to have, weights loaded
with torch's `load_state_dict`), never `load_model` itself."""
from __future__ import annotations

import copy
import socket

import huggingface_hub
import open_clip
import pytest
import torch
from fixtures.real_arch import register, shallow_config
from open_clip.model import convert_weights_to_lp
from open_clip.transformer import QuickGELU
from safetensors.torch import save_file

from clipfinetune.io import InputError
from clipfinetune.models import export_model, load_model, quick_gelu_setting

CAPTIONS = ["a red circle", "a small blue square to the left of a large green triangle"]
COMMIT = "0123456789abcdef0123456789abcdef01234567"     # any snapshot id: refs/main names it


@pytest.fixture(scope="module")
def names(tmp_path_factory):
    """Registered shallow configs: ViT-B-16 (no activation key, as open_clip ships it) and ViT-B-16-quickgelu."""
    folder = tmp_path_factory.mktemp("weights_configs")
    return {"plain": register(folder, "ViT-B-16-weights-test", shallow_config("ViT-B-16", 1, 1)),
            "quick": register(folder, "ViT-B-16-quickgelu-weights-test", shallow_config("ViT-B-16-quickgelu", 1, 1))}


@pytest.fixture(scope="module")
def images():
    return torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def weights(names):
    """One random-init state dict of the shallow ViT-B-16 (activations hold no weights: any model's fit both)."""
    torch.manual_seed(0)
    return open_clip.create_model(names["plain"]).state_dict()


def reference(name, state_dict, quick_gelu, images):
    """Plain open_clip with the given activation and weights: (image, text) embeddings."""
    clip = open_clip.create_model(name, quick_gelu=quick_gelu).eval()
    clip.load_state_dict(state_dict)
    with torch.no_grad():
        return (clip.encode_image(images, normalize=True),
                clip.encode_text(open_clip.get_tokenizer(name)(CAPTIONS), normalize=True))


def outputs(model, images):
    model.eval()
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(model.tokenize(CAPTIONS))


def activation(model) -> str:
    quick = any(isinstance(m, QuickGELU) for m in model.clip.modules())
    gelu = any(type(m) is torch.nn.GELU for m in model.clip.modules())
    assert quick != gelu
    return "quick_gelu" if quick else "gelu"


def assert_same(ours, theirs):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_quick_gelu_file_reloads_as_quick_gelu_with_identical_outputs(names, weights, images, tmp_path):
    path = tmp_path / "vit-b-16-quickgelu.pt"
    torch.save(weights, path)                                         # a bare state dict: no record
    expected = reference(names["plain"], weights, True, images)
    assert not torch.allclose(expected[0], reference(names["plain"], weights, False, images)[0], atol=1e-4)

    by_config = load_model(names["quick"], str(path))                # the -quickgelu config says it
    by_param = load_model(names["plain"], str(path), quick_gelu=True)
    for model in (by_config, by_param):
        assert activation(model) == "quick_gelu" and model.model_cfg["quick_gelu"] is True
        assert_same(outputs(model, images), expected)

    with pytest.raises(InputError, match="set model.quick_gelu: true"):   # ViT-B-16 + a file: unknowable
        load_model(names["plain"], str(path))
    with pytest.raises(InputError, match="disagreement"):
        load_model(names["quick"], str(path), quick_gelu=False)

    folder = export_model(by_param, tmp_path / "export")     # its open_clip_config.json records the activation
    beside = load_model(names["plain"], str(folder / "open_clip_model.safetensors"))
    assert activation(beside) == "quick_gelu"
    assert_same(outputs(beside, images), expected)


def test_gelu_file_reloads_as_gelu(names, weights, images, tmp_path):
    recorded = tmp_path / "gelu.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(recorded), metadata={"quick_gelu": "false"})
    wrapped = tmp_path / "gelu.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in weights.items()}, "quick_gelu": False}, wrapped)
    expected = reference(names["plain"], weights, False, images)
    for path in (recorded, wrapped):
        model = load_model(names["plain"], str(path))
        assert activation(model) == "gelu" and model.model_cfg["quick_gelu"] is False
        assert_same(outputs(model, images), expected)
    with pytest.raises(InputError, match="disagreement"):       # a param against the file's own record
        load_model(names["plain"], str(recorded), quick_gelu=True)
    with pytest.raises(InputError, match="disagreement"):       # a -quickgelu name against it
        load_model(names["quick"], str(wrapped))


def openai_archive(name, state_dict, path):
    """A TorchScript archive as OpenAI shipped theirs: a scripted QuickGELU CLIP with fp16 weights, its
    attention mask an attribute (not a buffer, so not in the archive's state dict) and `input_resolution`
    among its tensors (both as in OpenAI's `ViT-B-16.pt`). Returns its weights in fp32."""
    clip = open_clip.create_model(name, quick_gelu=True).eval()
    clip.load_state_dict(state_dict)
    convert_weights_to_lp(clip, torch.float16)
    clip.attn_mask = clip._buffers.pop("attn_mask")
    clip.register_buffer("input_resolution", torch.tensor(224))
    with pytest.warns(FutureWarning):                      # torch's deprecation notice of TorchScript
        torch.jit.script(clip).save(str(path))
    return {k: v.float() for k, v in clip.state_dict().items() if k != "input_resolution"}


@pytest.mark.filterwarnings("ignore:'torch.load' received a zip file")
def test_openai_torchscript_archive_loads_through_open_clips_loader(names, weights, images, tmp_path):
    path = tmp_path / "ViT-B-16.pt"
    archived = openai_archive(names["plain"], weights, path)
    with pytest.raises(RuntimeError, match="TorchScript"):         # what a weights-only read says of it
        torch.load(path, weights_only=True)
    model = load_model(names["plain"], str(path))
    assert activation(model) == "quick_gelu"
    assert_same(outputs(model, images), reference(names["plain"], archived, True, images))
    with pytest.raises(InputError, match="disagreement"):
        load_model(names["plain"], str(path), quick_gelu=False)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 against an empty cache in tmp_path, and no socket may connect."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)   # read at import, as the env var is
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    def refuse(*args, **kwargs):
        raise AssertionError("network access while offline")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return cache


def fill_cache(cache, tag_cfg, state_dict):
    """The Hugging Face cache layout of the tag's repo: refs/main -> snapshots/<commit>/open_clip_model.safetensors."""
    repo_id = tag_cfg["hf_hub"].rstrip("/")
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()},
              str(repo / "snapshots" / COMMIT / "open_clip_model.safetensors"))


def test_open_clip_tag_loads_offline_from_a_filled_cache(names, weights, images, offline_hub, monkeypatch):
    # ViT-B-16's real tags (their hf-hub repos, preprocessing and quick_gelu metadata), lent to the shallow config
    tags = {tag: copy.deepcopy(open_clip.get_pretrained_cfg("ViT-B-16", tag))
            for tag in ("openai", "laion2b_s34b_b88k")}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, names["plain"], tags)
    for tag_cfg in tags.values():
        fill_cache(offline_hub, tag_cfg, weights)
    # OpenAI trained with QuickGELU, LAION's open_clip runs with GELU
    for tag, quick_gelu in (("openai", True), ("laion2b_s34b_b88k", False)):
        model = load_model(names["plain"], tag)
        assert activation(model) == ("quick_gelu" if quick_gelu else "gelu")
        assert_same(outputs(model, images), reference(names["plain"], weights, quick_gelu, images))
    with pytest.raises(InputError, match="disagreement"):
        load_model(names["plain"], "openai", quick_gelu=False)


def test_a_tag_missing_from_the_offline_cache_says_how_to_fill_it(names, offline_hub, monkeypatch):
    tags = {"openai": copy.deepcopy(open_clip.get_pretrained_cfg("ViT-B-16", "openai"))}
    monkeypatch.setitem(open_clip.pretrained._PRETRAINED, names["plain"], tags)
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE=1.*timm/vit_base_patch16_clip_224.openai|"
                                           "timm/vit_base_patch16_clip_224.openai.*HF_HUB_OFFLINE=1"):
        load_model(names["plain"], "openai")


def test_quick_gelu_setting():
    assert quick_gelu_setting("auto") is None
    assert quick_gelu_setting(True) is True and quick_gelu_setting(False) is False
    with pytest.raises(ValueError, match="model.quick_gelu"):
        quick_gelu_setting("yes")
