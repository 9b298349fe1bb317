"""GOAL and MulCLIP methods (long captions, 248-token text) on crafted DOCCI shard records and tiny random CLIPs:
example shapes, box -> patches at two patch sizes, the sentence's token span, truncation, global-only records,
finite terms and gradients, the Long-CLIP stretch, MulCLIP's new-module parameter group."""
from __future__ import annotations

import copy
import json
import math
import random
import re

import open_clip
import pytest
import torch
from PIL import Image
from torch.utils.data import default_collate

from clipfinetune.data.loader import ExampleContext
from clipfinetune.methods import get_method
from clipfinetune.models import load_model
from clipfinetune.train.optim import parameter_groups

W, H = 120, 90                      # original image size (not square: the squash resize scales x and y apart)
CAPTION = ("A picture of four shapes on a grey background. There is a small red circle in the top left corner. "
           "A big blue square sits at the bottom middle. The lighting is flat and even.")
SENTENCES = ["A picture of four shapes on a grey background.", "There is a small red circle in the top left corner.",
             "A big blue square sits at the bottom middle.", "The lighting is flat and even."]


def spans(caption, sentences):
    out, at = [], 0
    for s in sentences:
        start = caption.index(s, at)
        out.append({"text": s, "char_span": [start, start + len(s)]})
        at = start + len(s)
    return out


def docci_record(i=0, box=(10, 5, 50, 40), sentence_index=1, caption=CAPTION, sentences=SENTENCES):
    return {"image_id": f"train_{i:05d}", "source": "docci", "width": W, "height": H, "captions": [],
            "long_caption": caption, "word_regions": [], "sentences": spans(caption, sentences),
            "local_pair": [] if box is None else [{"sentence_index": sentence_index, "box": list(box)}],
            "negatives": []}


def image(seed=0):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(H, W, 3, generator=g) * 255).to(torch.uint8).numpy())


def context(model):
    """The real ExampleContext, built from the model as the train stage does (248-token long tokenizer)."""
    return ExampleContext.of_model(model)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return load_model("cft-tiny-vit")              # 64 px input, 8 px patches, 8 x 8 grid


@pytest.fixture(scope="module")
def tiny16(tmp_path_factory):
    """The same tiny CLIP at 96 px with 16 px patches (6 x 6 grid)."""
    cfg = copy.deepcopy(open_clip.get_model_config("cft-tiny-vit"))
    cfg["vision_cfg"].update(image_size=96, patch_size=16)
    folder = tmp_path_factory.mktemp("cfg")
    (folder / "cft-tiny-vit-p16.json").write_text(json.dumps(cfg))
    open_clip.add_model_config(folder)
    torch.manual_seed(1)
    return load_model("cft-tiny-vit-p16")


def make_batch(method, model, records, seed=0):
    ctx, rng = context(model), random.Random(seed)
    return default_collate([method.make_example(r, image(i), rng, ctx) for i, r in enumerate(records)])


def expected_patches(box, size, patch):
    """Independent: squash-scale the original-pixel box to the input, list every patch it touches (row-major)."""
    x0, y0, x1, y1 = box[0] * size / W, box[1] * size / H, box[2] * size / W, box[3] * size / H
    grid = size // patch
    cols = range(int(x0 // patch), min(grid, math.ceil(x1 / patch)))
    rows = range(int(y0 // patch), min(grid, math.ceil(y1 / patch)))
    return sorted(r * grid + c for r in rows for c in cols)


def decode(model, ids):
    return re.sub(r" ([.,])", r"\1", model.tokenizer.decode([int(i) for i in ids]).strip())


# ------------------------------------------------------------------------------------------------ GOAL
def test_goal_example_shapes_and_span(tiny):
    model = copy.deepcopy(tiny)
    goal = get_method("goal")()
    ex = goal.make_example(docci_record(), image(), random.Random(0), context(model))
    assert ex["image"].shape == ex["local_image"].shape == (3, 64, 64)
    assert ex["text"].shape == ex["local_text"].shape == ex["span_mask"].shape == (248,)
    assert ex["box"].shape == (4,) and bool(ex["local_valid"]) and bool(ex["span_valid"])
    # the span covers exactly the sentence's tokens inside the long caption
    span_ids = ex["text"][ex["span_mask"]]
    assert decode(model, span_ids).lower() == SENTENCES[1].lower()
    assert span_ids.tolist() == model.tokenizer.encode(SENTENCES[1])
    positions = ex["span_mask"].nonzero()[:, 0].tolist()
    n_before = len(model.tokenizer.encode(" ".join(SENTENCES[:1])))
    assert positions == list(range(1 + n_before, 1 + n_before + len(span_ids)))      # contiguous, after SOT
    # the crop is the box itself (no enlargement), background kept
    crop = model.pixel_transform()(image().crop((10, 5, 50, 40)))
    assert torch.equal(ex["local_image"], crop)
    assert torch.allclose(ex["box"], torch.tensor([10 * 64 / W, 5 * 64 / H, 50 * 64 / W, 40 * 64 / H]))


@pytest.mark.parametrize("which", ["tiny", "tiny16"])
def test_goal_box_to_patches_matches_independent_grid(which, request):
    model = copy.deepcopy(request.getfixturevalue(which))
    size, patch = model.image_size, model.patch_size
    boxes = [(0, 0, W, H), (10, 5, 50, 40), (61, 44, 62, 46), (100, 70, 120, 90), (30, 0, 31, 90)]
    goal = get_method("goal")()
    built = goal.build(model)
    batch = make_batch(goal, model, [docci_record(i, box=b) for i, b in enumerate(boxes)])
    masks = model.box_patch_mask(batch["box"])
    for b, mask in zip(boxes, masks):
        assert mask.nonzero()[:, 0].tolist() == expected_patches(b, size, patch), b
    # and the region the forward pools is the mean of exactly those pre-ln_post patch states
    with torch.no_grad():
        features = built(batch)
        hidden = model.image_features(batch["image"])["hidden"]
    for i, b in enumerate(boxes):
        pooled = model.pool_image_hidden(hidden[i, expected_patches(b, size, patch)].mean(0, keepdim=True))[0]
        assert torch.allclose(features["region_pooled"][i], pooled, atol=1e-5)


def test_goal_truncated_span_and_missing_pair_are_flagged_and_counted(tiny):
    model = copy.deepcopy(tiny)
    goal = get_method("goal")()
    filler = [f"There is a small red circle number {i} in the top left corner of the picture." for i in range(20)]
    tail = "A lone green star hides at the very end."
    long_caption = " ".join(filler + [tail])
    assert len(model.tokenizer.encode(long_caption)) > 260
    truncated = docci_record(0, sentence_index=20, caption=long_caption, sentences=filler + [tail])
    no_pair = docci_record(1, box=None)
    records = [docci_record(2), truncated, no_pair, docci_record(3, sentence_index=3)]
    built = goal.build(model)
    batch = make_batch(goal, model, records)
    assert batch["span_valid"].tolist() == [True, False, False, True]
    assert batch["local_valid"].tolist() == [True, True, False, True]
    assert not batch["span_mask"][1].any()
    loss = goal.loss()
    terms = loss(built(batch))
    assert set(terms) == {"contrastive", "local_contrastive", "tsl_image", "tsl_text"}
    assert loss.stats == {"n_local": 3, "n_global_only": 1, "n_tsl_text_dropped": 1}


def test_goal_forward_backward_finite(tiny):
    model = copy.deepcopy(tiny)
    goal = get_method("goal")(lambda_global=1.0, lambda_local=0.5, lambda_tsl=1.0, tsl_target="diag")
    built = goal.build(model)
    batch = make_batch(goal, model, [docci_record(0), docci_record(1, box=None), docci_record(2, (60, 40, 119, 89), 2),
                                     docci_record(3, (0, 0, 30, 30), 3)])
    terms = goal.loss()(built(batch))
    assert all(torch.isfinite(t) and t.ndim == 0 for t in terms.values())
    assert all(float(terms[k].detach()) > 0 for k in ("contrastive", "local_contrastive", "tsl_image", "tsl_text"))
    sum(terms.values()).backward()
    grads = [p.grad for p in built.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.clip.positional_embedding.grad[:20].abs().sum() > 0          # GOAL trains all 248 rows


def test_goal_global_only_reads_no_local_inputs(tiny):
    model = copy.deepcopy(tiny)
    goal = get_method("goal")(lambda_global=1.0, lambda_local=0.0, lambda_tsl=0.0, tsl_target="diag")
    built = goal.build(model)
    batch = make_batch(goal, model, [docci_record(i) for i in range(4)])
    assert set(batch) == {"image", "text"}
    terms = goal.loss()(built(batch))
    assert float(terms["local_contrastive"].detach()) == 0 and float(terms["contrastive"].detach()) > 0


def test_stretch_happens_once_and_respects_a_long_base(tiny):
    model = copy.deepcopy(tiny)
    goal = get_method("goal")()
    goal.build(model)
    table = model.clip.positional_embedding.detach().clone()
    assert table.shape[0] == 248 and model.context_length == 248
    goal.build(model)                                             # idempotent
    assert torch.equal(model.clip.positional_embedding.detach(), table)
    get_method("mulclip")().build(model)                          # a base already at 248 is left alone
    assert torch.equal(model.clip.positional_embedding.detach(), table)
    assert not torch.nn.utils.parametrize.is_parametrized(model.clip, "positional_embedding")


# ------------------------------------------------------------------------------------------------ MulCLIP
def test_mulclip_example_shapes(tiny):
    model = copy.deepcopy(tiny)
    mulclip = get_method("mulclip")(max_sentences=6)
    ex = mulclip.make_example(docci_record(), image(), random.Random(0), context(model))
    assert ex["image"].shape == (3, 64, 64) and ex["text"].shape == (248,)
    assert ex["sub_text"].shape == (6, 248) and ex["sub_valid"].tolist() == [True] * 4 + [False] * 2
    assert decode(model, ex["sub_text"][0][1:int(ex["sub_text"][0].argmax())]).lower() == SENTENCES[0].lower()
    short = get_method("mulclip")(lambda_word=0.0, lambda_sub=0.0).make_example(
        docci_record(), image(), random.Random(0), context(model))
    assert set(short) == {"image", "text", "short"} and torch.equal(short["short"], ex["sub_text"][0])


def test_mulclip_new_modules_in_param_group_and_trained(tiny):
    model = copy.deepcopy(tiny)
    mulclip = get_method("mulclip")(lambda_short=0.5, lambda_word=1.0, lambda_sub=1.0, token_ratio=0.5,
                                     max_sentences=15, new_module_lr=2e-3)
    built = mulclip.build(model)
    assert model.context_length == 248
    assert torch.nn.utils.parametrize.is_parametrized(model.clip, "positional_embedding")   # rows 0..19 frozen
    assert not model.clip.logit_scale.requires_grad
    loss = mulclip.loss()
    new = {id(p) for p in loss.parameters()}
    assert new and new <= {id(p) for p in built.parameters()}               # optimised/checkpointed with the module
    assert any(k.startswith("new_modules.") for k in built.state_dict())
    groups = parameter_groups(built, 1e-4, 0.1, mulclip.param_groups(built))
    by_name = {g["name"]: g for g in groups}
    claimed = [id(p) for g in groups if g["name"].startswith("new_modules") for p in g["params"]]
    assert sorted(claimed) == sorted(new) and len(claimed) == len(set(claimed))
    assert by_name["new_modules"]["lr"] == by_name["new_modules_no_decay"]["lr"] == 2e-3
    no_decay = {id(p) for p in by_name["new_modules_no_decay"]["params"]}
    for head in loss.heads.values():
        assert {id(head.logit_scale), id(head.logit_bias)} <= no_decay
    all_ids = [id(p) for g in groups for p in g["params"]]
    assert len(all_ids) == len(set(all_ids))                                 # each parameter optimised once

    records = [docci_record(i, sentences=SENTENCES[:1 + i]) for i in range(4)]
    records = [dict(r, long_caption=CAPTION) for r in records]
    batch = make_batch(mulclip, model, records)
    features = built(batch)
    assert features["text_tokens"].shape[1] == 248
    terms = loss(features)
    assert set(terms) == {"contrastive", "contrastive_short", "word_patch", "subcaption_patch"}
    assert all(torch.isfinite(t) for t in terms.values())
    sum(terms.values()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in loss.parameters())
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in built.parameters())
    assert model.clip.transformer.resblocks[0].attn.in_proj_weight.grad is not None


def test_mulclip_trimmed_text_equals_full_context(tiny):
    """Zero-padding the trimmed text states to 248 gives the loss of encoding all 248 positions."""
    model = copy.deepcopy(tiny)
    mulclip = get_method("mulclip")(max_sentences=4)
    built = mulclip.build(model)
    loss = mulclip.loss()
    batch = make_batch(mulclip, model, [docci_record(i) for i in range(4)])
    with torch.no_grad():
        features = built(batch)
        full = model.text_features(batch["text"], trim=False)
        reference = dict(features, text_tokens=full["tokens"], text_mask=full["mask"])
        a, b = loss(features), loss(reference)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


def test_mulclip_global_only_freezes_unused_new_modules(tiny):
    model = copy.deepcopy(tiny)
    mulclip = get_method("mulclip")(lambda_short=0.5, lambda_word=0.0, lambda_sub=0.0, token_ratio=0.5,
                                     max_sentences=15, new_module_lr=2e-3)
    built = mulclip.build(model)
    trainable = [n for n, p in built.new_modules.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("heads.global.") for n in trainable)
    batch = make_batch(mulclip, model, [docci_record(i) for i in range(4)])
    terms = mulclip.loss()(built(batch))
    sum(terms.values()).backward()
    assert all(p.grad is not None for p in built.parameters() if p.requires_grad)   # nothing left for DDP to wait on


# ------------------------------------------------------------------------------------------------ the real loop
class ListSource:
    """One epoch = the given micro-batches."""

    def __init__(self, micro_batches):
        self.micro_batches = micro_batches

    def epoch_length(self, epoch):
        return len(self.micro_batches)

    def batches(self, epoch, start=0):
        yield from self.micro_batches[start:]


def test_trainer_optimises_and_checkpoints_mulclip_new_modules_once(tiny, tmp_path):
    from clipfinetune.train import TrainConfig, Trainer
    from clipfinetune.train.checkpoint import load_checkpoint

    model = copy.deepcopy(tiny)
    mulclip = get_method("mulclip")(max_sentences=4, new_module_lr=2e-3)
    ctx_model = copy.deepcopy(tiny)
    micro = [make_batch(mulclip, ctx_model, [docci_record(i), docci_record(i + 1)]) for i in (0, 2)]
    cfg = TrainConfig(epochs=1, batch_size=4, lr=1e-4, accum_steps=2, grad_clip=1.0)    # feature-cache path
    trainer = Trainer(mulclip, model, ListSource(micro), cfg, checkpoint_dir=tmp_path)
    assert trainer.loss_fn is trainer.module.new_modules                    # the loss IS the module's submodule
    groups = {g["name"]: g for g in trainer.optimizer.param_groups}
    ids = [id(p) for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and groups["new_modules"]["lr"] == 2e-3
    before = {n: p.detach().clone() for n, p in trainer.module.new_modules.named_parameters() if p.requires_grad}
    scale = model.clip.logit_scale.detach().clone()
    trainer.fit()
    after = dict(trainer.module.new_modules.named_parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(model.clip.logit_scale, scale)                       # frozen: unused by the sigmoid loss
    state = load_checkpoint(tmp_path / "last.pt")["model"]
    for n in before:
        assert torch.equal(state[f"new_modules.{n}"], after[n].detach())
