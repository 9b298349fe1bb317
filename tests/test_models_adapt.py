"""Long-CLIP stretching, LoRA, teachers and freezing."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from clipfinetune.models import (
    apply_lora,
    ema_teacher,
    ema_update,
    extend_context,
    freeze_tower,
    freeze_vision_blocks,
    frozen_teacher,
    has_lora,
    load_model,
    merge_lora,
    stretch_positional_embedding,
)

LONG_CAPTION = " ".join(f"the shape number {i} is a red circle." for i in range(20))


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return load_model("cft-tiny-vit").eval()


@pytest.fixture
def model(base):
    return copy.deepcopy(base)


@pytest.fixture(scope="module")
def batch(base):
    images = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    return images, base.tokenize(["a red circle", "a blue square left of a green triangle"])


def _outputs(model, images, tokens):
    with torch.no_grad():
        return (model.encode_image(images), model.encode_text(tokens), model.dense_features(images))


def _assert_outputs_close(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


# ---- Long-CLIP ---------------------------------------------------------------------------------------
def test_stretched_table_follows_long_clip_row_by_row():
    table = torch.randn(77, 6, dtype=torch.float64)
    new = stretch_positional_embedding(table, keep=20, ratio=4)
    assert new.shape == (248, 6)
    torch.testing.assert_close(new[:20], table[:20])
    for i in range(56):
        for j in range(4):
            torch.testing.assert_close(new[20 + 4 * i + j], (1 - j / 4) * table[20 + i] + (j / 4) * table[21 + i])
        torch.testing.assert_close(new[20 + 4 * i], table[20 + i])
    for j in range(4):
        torch.testing.assert_close(new[244 + j], table[76] + j * (table[76] - table[75]) / 4)


def test_extend_context_gives_a_248_token_model(model):
    old_table = model.clip.positional_embedding.detach().clone()
    extend_context(model, length=248, keep=20)
    assert model.context_length == 248 and model.clip.positional_embedding.shape == (248, old_table.shape[1])
    torch.testing.assert_close(model.clip.positional_embedding[:20].detach(), old_table[:20])
    tokens = model.tokenize([LONG_CAPTION, "short"])
    assert tokens.shape == (2, 248) and int((tokens[0] != 0).sum()) > 77
    with torch.no_grad():
        torch.testing.assert_close(model.encode_text(tokens), model.clip.encode_text(tokens, normalize=True),
                                   rtol=1e-5, atol=1e-6)


def test_extend_context_with_another_keep_and_ratio(model):
    extend_context(model, keep=10, ratio=2)
    assert model.context_length == 10 + 2 * 67


def _one_optimiser_step(model):
    tokens = model.tokenize([LONG_CAPTION])
    optimiser = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1, weight_decay=0.1)
    model.text_features(tokens, trim=False)["tokens"].square().sum().backward()
    optimiser.step()


def test_freeze_kept_keeps_rows_0_to_19_through_an_optimiser_step(model):
    extend_context(model, freeze_kept=True)
    before = model.clip.positional_embedding.detach().clone()
    _one_optimiser_step(model)
    after = model.clip.positional_embedding.detach()
    torch.testing.assert_close(after[:20], before[:20], rtol=0, atol=0)
    assert (after[20:] != before[20:]).any(dim=1).all()


def test_without_freeze_kept_every_row_trains(model):
    extend_context(model, freeze_kept=False)
    before = model.clip.positional_embedding.detach().clone()
    _one_optimiser_step(model)
    assert (model.clip.positional_embedding.detach()[:20] != before[:20]).any(dim=1).all()


# ---- LoRA --------------------------------------------------------------------------------------------
def test_zero_init_lora_leaves_outputs_unchanged(base, model, batch):
    apply_lora(model, rank=4, init="zero")
    assert has_lora(model)
    _assert_outputs_close(_outputs(model, *batch), _outputs(base, *batch))


def test_fsc_clip_init_perturbs_outputs(base, model, batch):
    apply_lora(model, rank=4, init="fsc_clip")
    image, text, _ = _outputs(model, *batch)
    reference_image, reference_text, _ = _outputs(base, *batch)
    assert not torch.allclose(image, reference_image, atol=1e-4)
    assert not torch.allclose(text, reference_text, atol=1e-4)
    assert isinstance(model.clip.visual.conv1, nn.Conv2d) and hasattr(model.clip.visual.conv1, "lora_A")


@pytest.mark.parametrize("init", ["zero", "fsc_clip"])
def test_merged_lora_equals_unmerged(base, model, batch, init):
    apply_lora(model, rank=4, init=init, dropout=0.1)
    with torch.no_grad():                           # move every B off zero so each LoRA path matters
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.add_(0.05 * torch.randn_like(param))
    model.eval()
    unmerged = _outputs(model, *batch)
    merge_lora(model)
    assert not has_lora(model)
    assert model.clip.state_dict().keys() == base.clip.state_dict().keys()
    _assert_outputs_close(_outputs(model, *batch), unmerged)
    assert not torch.allclose(unmerged[0], _outputs(base, *batch)[0], atol=1e-4)


def test_lora_trains_only_low_rank_parameters(model):
    rank, width, layers = 4, 128, 4
    apply_lora(model, rank=rank, init="zero")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    per_block = rank * width + 3 * width * rank + 2 * rank * width + (rank * width + 4 * width * rank) * 2
    assert sum(p.numel() for p in trainable.values()) == 2 * layers * per_block


# ---- teachers ----------------------------------------------------------------------------------------
def test_ema_update_follows_the_formula_after_n_steps(model):
    teacher = ema_teacher(model)
    initial = {n: p.detach().clone().double() for n, p in teacher.named_parameters()}
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.add_(0.1 * (index % 7) - 0.3)
    student = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    alpha, steps = 0.9, 5
    for _ in range(steps):
        ema_update(teacher, model, alpha)
    for name, param in teacher.named_parameters():     # closed form for a constant student
        expected = alpha ** steps * initial[name] + (1 - alpha ** steps) * student[name]
        torch.testing.assert_close(param.detach().double(), expected, rtol=1e-5, atol=1e-6)


def test_teachers_take_no_gradients_and_do_not_follow_the_student(model, batch):
    images, tokens = batch
    teacher, frozen = ema_teacher(model), frozen_teacher(model)
    snapshot = [p.detach().clone() for p in frozen.parameters()]
    loss = model.encode_image(images).sum() + teacher.encode_image(images).sum() + frozen.encode_text(tokens).sum()
    loss.backward()
    assert all(not p.requires_grad and p.grad is None for t in (teacher, frozen) for p in t.parameters())
    assert not teacher.training and not frozen.training
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(snapshot, frozen.parameters()))


def test_freeze_vision_blocks_freezes_the_stem_and_first_blocks_only(model):
    freeze_vision_blocks(model, 2)
    visual = model.clip.visual
    assert not visual.conv1.weight.requires_grad and not visual.class_embedding.requires_grad
    assert not any(p.requires_grad for b in visual.transformer.resblocks[:2] for p in b.parameters())
    assert all(p.requires_grad for b in visual.transformer.resblocks[2:] for p in b.parameters())
    assert visual.proj.requires_grad and model.clip.transformer.resblocks[0].attn.in_proj_weight.requires_grad


def test_freeze_tower_text_leaves_vision_trainable(model):
    freeze_tower(model, "text")
    frozen = {n for n, p in model.clip.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in model.clip.named_parameters() if not n.startswith(("visual.", "logit_scale"))}
