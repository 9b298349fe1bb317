"""The papers' backbones at full depth, random init (issue 24), run by `make test-real` (not collected by `make
test`): HarmoCLIP's EVA02-CLIP-B/16 (open_clip `EVA02-B-16`: timm `eva02_base_patch16_clip_224` image tower, 12
blocks, rotary positions, SwiGLU MLPs; `CustomTextCLIP`) and DeGLA's ViT-B/32, one optimiser step each on CPU at
224 px with a batch of 2 (tests/test_real_arch.py runs the same steps with 1-2 blocks per tower). The EVA02 model
trained by HarmoCLIP is exported and read back by plain open_clip."""
from __future__ import annotations

import open_clip
import pytest
import torch
from test_real_arch import assert_export_matches_plain_open_clip, train_one_step

from clipfinetune.models import load_model


@pytest.mark.parametrize("name,run", [("EVA02-B-16", "harmoclip"), ("ViT-B-32", "degla")])
def test_one_train_step_at_the_papers_backbone(name, run, tmp_path):
    torch.manual_seed(0)
    model = load_model(name)                                    # open_clip's own config, random init
    with torch.device("meta"):
        reference = open_clip.create_model(name, device="meta")
    assert [(k, p.shape) for k, p in model.clip.named_parameters()] == \
        [(k, p.shape) for k, p in reference.named_parameters()]  # the full architecture, every block
    assert (model.image_size, model.grid, model.embed_dim) == (224, (14, 14) if name == "EVA02-B-16" else (7, 7), 512)
    method, trainer, trained, scalars, before, missing = train_one_step(model, run)
    assert missing == [] and all(torch.isfinite(torch.tensor(v)) for k, v in scalars.items() if k.startswith("loss"))
    moved = [not torch.equal(b, p) for b, p in zip(before, trainer.params)]
    assert all(m or not p.grad.any() for m, p in zip(moved, trainer.params)) and sum(moved) > len(moved) / 2
    if name == "EVA02-B-16":
        assert_export_matches_plain_open_clip(method.final_model(trainer.module, trained), tmp_path / "export")
