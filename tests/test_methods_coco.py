"""HarmoCLIP, FSC-CLIP and DeGLA methods: examples from crafted shard records, and one forward/backward on a tiny
random CLIP (loss term names, finite gradients, frozen/EMA teachers, cheap ablations)."""
from __future__ import annotations

import copy
import random
import re

import pytest
import torch
from fixtures.methods import (
    FixedNegatives,
    collate_examples,
    example_context,
    no_negatives,
    random_image,
    shard_record,
    tiny_model,
)
from torch.utils.data import default_collate

from clipfinetune.methods import get_method

W, H = 100, 50                       # original image size; the tiny model's input is 64 x 64
S = 64


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def image(seed=0):
    return random_image(seed, W, H)


def decode(model, ids):
    """Token ids -> text, with CLIP's decoder's space before punctuation removed."""
    return re.sub(r" ([.,])", r"\1", model.tokenizer.decode([int(i) for i in ids]).strip())


def coco_record(i=0):
    return shard_record(
        str(i), "coco", W, H,
        captions=[f"two hippopotamuses beside a red circle number {i}.",
                  f"a blue square above {i} green triangles"],
        word_regions=[{"caption_index": 0, "word": "hippopotamuses", "char_span": [4, 18],
                       "box": [10, 20, 30, 40], "category": "hippo"}],
        negatives=[{"caption_index": 1, "type": "replace_nouns", "texts": ["a blue circle above triangles"]},
                   {"caption_index": 1, "type": "reshuffle", "texts": ["triangles above a blue square"]},
                   {"caption_index": 1, "type": "swap_adjectives", "texts": ["a green square above blue"]}])


DOCCI = shard_record("d", "docci", W, H, long_caption="long",
                     sentences=[{"text": "long", "char_span": [0, 4]}])


def batch_of(method, model, ctx, n=4):
    return collate_examples(method, [coco_record(i) for i in range(n)], ctx)


def backward_and_check(model, terms, names):
    assert set(terms) == names
    assert all(torch.isfinite(t) and t.ndim == 0 for t in terms.values())
    sum(terms.values()).backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


# ------------------------------------------------------------------------------------------------ HarmoCLIP
def test_harmoclip_example_word_mask_box_and_crop(tiny):
    method, ctx = get_method("harmoclip")(), example_context(tiny)
    assert method.wants(coco_record()) and not method.wants(DOCCI)
    ex = method.make_example(coco_record(), image(), random.Random(0), ctx)
    assert decode(tiny, ex["text"][ex["word_mask"]]) == "hippopotamuses"      # a multi-BPE word, all its tokens
    assert int(ex["word_mask"].sum()) > 1
    assert decode(tiny, ex["text"][ex["text"] != 0][1:-1]) == coco_record()["captions"][0].lower()
    torch.testing.assert_close(ex["box"], torch.tensor([10 * 0.64, 20 * 1.28, 30 * 0.64, 40 * 1.28]))
    # the crop: the box 1.5x about its centre (20, 30) = [5, 15, 35, 45], inside the 100 x 50 image
    torch.testing.assert_close(ex["crop"], tiny.pixel_transform()(image().crop((5, 15, 35, 45))))
    assert ex["crop"].shape == ex["image"].shape == (3, S, S)
    assert bool(ex["pair_valid"]) and ex["category"].dtype == torch.long


def test_harmoclip_forward_terms_grads_and_frozen_teacher(tiny):
    method = get_method("harmoclip")(lambda_lrc=1.0, lambda_gr=1.0, unlocked_vision_layers=-1)
    model = copy.deepcopy(tiny)
    module = method.build(model)
    module.train()
    assert not module.teacher.training
    features = module(batch_of(method, model, example_context(model)))
    assert features["region"].shape == features["region_teacher"].shape == (4, model.embed_dim)
    backward_and_check(model, method.loss()(features), {"contrastive", "lexeme_region", "global_region"})
    assert all(p.grad is None and not p.requires_grad for p in module.teacher.parameters())
    assert not features["region_teacher"].requires_grad


def test_harmoclip_unlocked_vision_layers_freezes_earlier_blocks(tiny):
    method = get_method("harmoclip")(unlocked_vision_layers=1)
    model = copy.deepcopy(tiny)
    module = method.build(model)
    terms = method.loss()(module(batch_of(method, model, example_context(model))))
    sum(terms.values()).backward()
    blocks = model.clip.visual.transformer.resblocks
    for block in blocks[:-1]:
        assert all(p.grad is None for p in block.parameters())
    assert model.clip.visual.conv1.weight.grad is None
    assert all(p.grad is not None for p in blocks[-1].parameters())
    assert model.clip.token_embedding.weight.grad is not None


# ------------------------------------------------------------------------------------------------ FSC-CLIP
def test_fsc_clip_example_negatives_and_placeholder(tiny):
    caption = coco_record()["captions"][0]
    negatives = {caption: {"negclip": "two circles beside a red hippopotamuses number 0.", "replace": None,
                           "shuffle": "a red circle two hippopotamuses beside number 0."}}
    fixed = FixedNegatives(lambda c: negatives.get(c, no_negatives(c)))
    method, ctx = fixed.on(get_method("fsc_clip")()), example_context(tiny)
    assert method.wants(coco_record()) and not method.wants(DOCCI)
    rng = random.Random(3)
    record = dict(coco_record(), captions=[caption])
    ex = method.make_example(record, image(), rng, ctx)
    assert fixed.calls == [(caption, rng)]                   # fresh negatives from the loader's rng
    assert ex["text"].shape == (4, tiny.context_length)
    assert ex["neg_valid"].tolist() == [True, False, True]
    texts = [decode(tiny, row[row != 0][1:-1]) for row in ex["text"]]
    assert texts == [caption.lower(), negatives[caption]["negclip"], "", negatives[caption]["shuffle"]]


def test_fsc_clip_draws_its_rule_negatives_from_the_rules_module_with_the_loaders_rng(monkeypatch):
    """The online negatives are FSC-CLIP's own (the shared ExampleContext knows nothing of them): each call draws
    with the rng it is given."""
    import sys
    import types

    fake = types.ModuleType("clipfinetune.data.negatives.rules")
    fake.online_negatives = lambda caption, rng: {"negclip": caption[::-1], "replace": None, "shuffle": rng.random()}
    monkeypatch.setitem(sys.modules, "clipfinetune.data.negatives.rules", fake)
    out = get_method("fsc_clip")().rule_negatives("abc", random.Random(1))
    assert out == {"negclip": "cba", "replace": None, "shuffle": random.Random(1).random()}


def test_fsc_clip_forward_terms_and_grads(tiny):
    method = get_method("fsc_clip")(lambda_g=0.5, lambda_l=0.5, focal_gamma=2.0, label_smoothing=0.02)
    model = copy.deepcopy(tiny)
    module = method.build(model)
    caption_negs = {"negclip": "x y z", "replace": "a b", "shuffle": None}
    FixedNegatives(lambda c: caption_negs).on(method)
    ctx = example_context(model)
    features = module(batch_of(method, model, ctx))
    b, c, length, d = features["text_tokens"].shape
    assert (b, c, d) == (4, 4, model.embed_dim) and features["text_mask"].shape == (4, 4, length)
    assert features["patches"].shape == (4, model.num_patches, model.embed_dim)
    assert features["neg_text"].shape == (4, 3, model.embed_dim)
    backward_and_check(model, method.loss()(features), {"contrastive", "global_hn", "local_hn"})


def test_fsc_clip_global_only_never_computes_token_features(tiny, monkeypatch):
    model = copy.deepcopy(tiny)
    calls = {"image_features": 0, "text_features": 0}
    for name in calls:
        original = getattr(model, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(model, name, counted)
    ctx = example_context(model)
    fixed = FixedNegatives(lambda c: {"negclip": "x y z", "replace": "a b", "shuffle": "c d"})
    method = fixed.on(get_method("fsc_clip")(lambda_g=0.5, lambda_l=0.0))
    features = method.build(model)(batch_of(method, model, ctx))
    assert calls == {"image_features": 0, "text_features": 0}
    assert "text_tokens" not in features and "patches" not in features
    backward_and_check(model, method.loss()(features), {"contrastive", "global_hn", "local_hn"})
    full = fixed.on(get_method("fsc_clip")(lambda_g=0.5, lambda_l=0.5))
    full.build(model)(batch_of(full, model, ctx))
    assert calls == {"image_features": 1, "text_features": 1}          # ONE image and ONE text forward


def test_fsc_clip_lora_trains_only_lora_and_merges(tiny):
    method = get_method("fsc_clip")(lora_rank=4, lora_lr=5e-5)
    model = copy.deepcopy(tiny)
    module = method.build(model)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert not model.clip.logit_scale.requires_grad
    (group,) = method.param_groups(module)
    assert group["lr"] == 5e-5 and len(group["params"]) == len(trainable)
    x = torch.randn(2, 3, S, S)
    with torch.no_grad():
        before = model.encode_image(x)
        merged = method.final_model(module, model)
        torch.testing.assert_close(merged.encode_image(x), before, rtol=1e-4, atol=1e-5)
    assert not any("lora" in n for n, _ in merged.named_parameters())


# ------------------------------------------------------------------------------------------------ DeGLA
def test_degla_example_picks_a_caption_with_negatives_in_type_order(tiny):
    method, ctx = get_method("degla")(), example_context(tiny)
    assert method.wants(coco_record()) and not method.wants(DOCCI)
    assert not method.wants(dict(coco_record(), negatives=[]))
    for seed in range(3):
        ex = method.make_example(coco_record(), image(), random.Random(seed), ctx)
        texts = [decode(tiny, row[row != 0][1:-1]) for row in ex["text"]]
        assert texts == [coco_record()["captions"][1], "triangles above a blue square", "a green square above blue",
                         "a blue circle above triangles", ""]
        assert ex["neg_valid"].tolist() == [True, True, True, False]


def test_degla_forward_teacher_no_grad_and_ema_step(tiny):
    method = get_method("degla")(lambda_igc=0.1, lambda_tgc=0.1, lambda_distill=0.005, ema_alpha=0.9,
                                 tgc_logit_scale=10.0)
    model = copy.deepcopy(tiny)
    module = method.build(model)
    module.train()
    assert not module.teacher.training
    assert any(k.startswith("teacher.") for k in module.state_dict())          # checkpointed with the run
    features = module(batch_of(method, model, example_context(model)))
    assert features["neg_text"].shape == features["teacher_neg_text"].shape == (4, 4, model.embed_dim)
    assert not any(features[k].requires_grad for k in ("teacher_image", "teacher_text", "teacher_neg_text"))
    backward_and_check(model, method.loss()(features), {"contrastive", "igc", "tgc", "distill"})
    assert all(p.grad is None for p in module.teacher.parameters())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))                 # a student that has moved away from the teacher
    teacher_before = {n: p.detach().clone() for n, p in module.teacher.named_parameters()}
    student = {n: p.detach().clone() for n, p in model.named_parameters()}
    method.after_step(module)
    for n, p in module.teacher.named_parameters():
        torch.testing.assert_close(p, 0.9 * teacher_before[n] + 0.1 * student[n])


def test_degla_without_distill_runs_teacher_on_positives_only(tiny):
    method = get_method("degla")(lambda_distill=0.0)
    model = copy.deepcopy(tiny)
    features = method.build(model)(batch_of(method, model, example_context(model)))
    assert "teacher_image" not in features and features["teacher_text"].shape == (4, model.embed_dim)
    terms = method.loss()(features)
    assert float(terms["distill"].detach()) == 0.0
    backward_and_check(model, terms, {"contrastive", "igc", "tgc", "distill"})


# ------------------------------------------------------------------------------------------------ all three
@pytest.mark.parametrize("name", ["harmoclip", "fsc_clip", "degla"])
def test_micro_batches_of_different_text_lengths_concatenate(tiny, name):
    """Gradient accumulation concatenates micro-batches' features along dim 0 (train.loop.merge_features)."""
    from clipfinetune.train.loop import merge_features

    method = get_method(name)()
    model = copy.deepcopy(tiny)
    module = method.build(model)
    FixedNegatives(lambda c: {"negclip": "a b", "replace": None, "shuffle": "c d"}).on(method)
    ctx = example_context(model)
    short, long = coco_record(0), coco_record(1)
    long["captions"] = [c + " and a very long tail of many more words" * 3 for c in long["captions"]]
    for record in (short, long):
        for entry in record["negatives"]:
            entry["texts"] = [t + " x" for t in entry["texts"]]
    rng = random.Random(0)
    parts = [module(default_collate([method.make_example(r, image(), rng, ctx)] * 2)) for r in (short, long)]
    merged = merge_features(parts, 1, True)
    assert all(v.shape[0] == 4 for v in merged.values() if v.ndim > 0)
    assert all(torch.isfinite(t) for t in method.loss()(merged).values())


def lexeme_region_grads(model, lexeme_projection_grad):
    """Backward of L_LRC alone; returns (text projection grad, text transformer grads)."""
    method = get_method("harmoclip")(lambda_gr=0.0, lexeme_projection_grad=lexeme_projection_grad)
    module = method.build(model)
    terms = method.loss()(module(batch_of(method, model, example_context(model))))
    terms["lexeme_region"].backward()
    return model.clip.text_projection.grad, [p.grad for p in model.clip.transformer.parameters()]


def test_harmoclip_word_features_default_keep_lrc_gradient_out_of_text_projection(tiny):
    grad, transformer_grads = lexeme_region_grads(copy.deepcopy(tiny), lexeme_projection_grad=False)
    assert grad is None or not bool(grad.abs().sum() > 0)       # eqs. 3-4: the projection gets no L_LRC gradient
    assert any(g is not None and bool(g.abs().sum() > 0) for g in transformer_grads)


def test_harmoclip_projected_word_features_option_trains_text_projection(tiny):
    grad, _ = lexeme_region_grads(copy.deepcopy(tiny), lexeme_projection_grad=True)
    assert grad is not None and bool(grad.abs().sum() > 0)


@pytest.mark.parametrize("lexeme_projection_grad", [False, True])
def test_harmoclip_word_features_match_float64_eqs_3_4(tiny, lexeme_projection_grad):
    """Same values either way: the word tokens' states after ln_final, mapped by the text projection (reference)."""
    from reference import harmoclip_reference as ref

    from clipfinetune.losses.harmoclip import lexeme_features

    method = get_method("harmoclip")(lambda_gr=0.0, lexeme_projection_grad=lexeme_projection_grad)
    model = copy.deepcopy(tiny)
    batch = batch_of(method, model, example_context(model))
    features = method.build(model)(batch)
    with torch.no_grad():
        normed = model.clip.ln_final(model.text_features(batch["text"], trim=False)["hidden"])
    got = lexeme_features(features["text_tokens"], features["word_mask"])
    for i in range(len(batch["text"])):
        want = ref.lexeme_from_hidden(normed, model.clip.text_projection.detach(), batch["word_mask"], i)
        torch.testing.assert_close(got[i].double(), want / want.norm(), atol=1e-5, rtol=1e-5)


def test_epoch_units_narrow_the_record_to_the_unit_the_example_draws(tiny):
    """`train.epoch_unit: method`: HarmoCLIP's unit is a word-region row, DeGLA's a caption with negatives, FSC-CLIP's
    and CLIP's a caption; the example made from `unit_record(record, i)` holds unit i whatever the rng draws."""
    ctx = example_context(tiny)
    record = coco_record(3)
    record["word_regions"].append({"caption_index": 1, "word": "square", "char_span": [7, 13],
                                   "box": [50, 0, 100, 25], "category": "square"})
    record["negatives"].append({"caption_index": 0, "type": "swap_nouns", "texts": ["two circles beside a red hippo"]})
    harmo, degla, fsc = (get_method(n)() for n in ("harmoclip", "degla", "fsc_clip"))
    FixedNegatives(no_negatives).on(fsc)
    assert (harmo.epoch_unit, degla.epoch_unit, fsc.epoch_unit, get_method("goal").epoch_unit) == \
        ("word_region", "caption", "caption", "image")
    assert harmo.units(record) == degla.units(record) == fsc.units(record) == 2

    def example(method, unit, seed):
        return method.make_example(method.unit_record(record, unit), image(), random.Random(seed), ctx)

    def caption(ids):                                   # between SOT and EOT (the largest id)
        return decode(tiny, ids[1:int(ids.argmax())])

    for seed in range(4):
        words = [example(harmo, i, seed) for i in range(2)]
        assert [decode(tiny, e["text"][e["word_mask"]]) for e in words] == ["hippopotamuses", "square"]
        assert [e["box"].tolist() for e in words] == [ctx.resize_boxes([r["box"]], (W, H))[0].tolist()
                                                      for r in record["word_regions"]]
        assert [caption(example(degla, i, seed)["text"][0]) for i in range(2)] == record["captions"]
        assert [caption(example(fsc, i, seed)["text"][0]) for i in range(2)] == record["captions"]
