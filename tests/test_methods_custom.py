"""The `custom` loss mix (issue 14): the mix equals the weighted sum of each method's own terms on the same batch
(values and gradients), shared image features are computed once, term parsing."""
from __future__ import annotations

import copy

import pytest
import torch
from fixtures.methods import FixedNegatives, collate_examples, example_context, shard_record, tiny_model
from fixtures.methods import coco_record as mixed_coco_record

from clipfinetune.methods import get_method

W, H = 120, 90
DOCCI = shard_record("train_00000", "docci", W, H, long_caption="A red circle.",
                     sentences=[{"text": "A red circle.", "char_span": [0, 13]}])


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


# ------------------------------------------------------------------------------------------------ custom
def reversed_and_recoloured(caption):
    """Fixed stand-ins for FSC-CLIP's rule negatives (no spaCy in a unit test)."""
    return {"negclip": " ".join(caption.split()[::-1]), "replace": caption.replace("red", "blue"),
            "shuffle": None}


def coco_record(i):
    return mixed_coco_record(i, W, H, box=(10, 20, 60, 70))


def perturb(model):
    """The same small deterministic change to every copy's student weights (after the teachers were copied)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, p in sorted(model.clip.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def test_custom_equals_weighted_sum_of_each_methods_own_terms(tiny):
    terms = {"fsc_clip.local_hn": 0.5, "degla.distill": 0.005, "harmoclip.global_region": 1.0}   # params.yaml mix
    custom = get_method("custom")(terms=terms)
    model = copy.deepcopy(tiny)
    module, loss = custom.build(model), custom.loss()
    perturb(model)
    records = [coco_record(i) for i in range(4)]
    assert all(custom.wants(r) for r in records)
    assert not custom.wants(dict(records[0], negatives=[])) and not custom.wants(DOCCI)
    batch = collate_examples(FixedNegatives(reversed_and_recoloured).on(custom), records, example_context(model))

    calls = []
    visual = model.clip.visual
    original = visual.forward_intermediates
    visual.forward_intermediates = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out = loss(module(batch))
    finally:
        del visual.forward_intermediates
    assert len(calls) == 2          # clip, fsc_clip, degla share one image forward; harmoclip's dense one is another
    assert set(out) == {"clip.contrastive", "fsc_clip.local_hn", "degla.distill", "harmoclip.global_region"}
    sum(out.values()).backward()

    # each method alone, at its DEFAULT lambdas (which these weights equal), on its own copy of the same model
    expected, grads = {}, {}
    for name, term in [("clip", "contrastive"), ("fsc_clip", "local_hn"), ("degla", "distill"),
                       ("harmoclip", "global_region")]:
        method, own = get_method(name)(), copy.deepcopy(tiny)
        built = method.build(own)
        perturb(own)
        view = {k[len(name) + 1:]: v for k, v in batch.items() if k.startswith(name + ".")}
        value = method.loss()(dict(built(dict(view, image=batch["image"]))))[term]
        value.backward()
        expected[f"{name}.{term}"] = value.detach()
        for n, p in own.clip.named_parameters():
            if p.grad is not None:
                grads[n] = grads.get(n, 0) + p.grad
    for key, value in expected.items():
        assert torch.allclose(out[key].detach(), value, rtol=1e-5, atol=1e-7), key
    assert float(expected["degla.distill"]) > 0 and float(expected["harmoclip.global_region"]) > 0
    for n, p in model.clip.named_parameters():
        if n in grads:
            assert p.grad is not None and torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n
        else:
            assert p.grad is None or not p.grad.any(), n


def test_custom_term_parsing():
    custom = get_method("custom")
    with pytest.raises(ValueError, match="unknown term"):
        custom(terms={"fsc_clip.local_hnn": 1.0})
    only_goal = custom(terms={"clip.contrastive": 0, "goal.tsl_image": 2.0})
    assert list(only_goal.methods) == ["goal"] and only_goal.weights == {"goal": {"tsl_image": 2.0}}
    goal = only_goal.methods["goal"]
    assert (goal.lambda_global, goal.lambda_local, goal.lambda_tsl) == (0.0, 0.0, 1.0)
    assert list(custom(terms={}).weights) == ["clip"]


def docci_record(i):
    caption = f"A picture of {i} shapes. There is a red circle in the top left corner."
    second = caption.index("There")
    return shard_record(f"train_{i:05d}", "docci", W, H, long_caption=caption,
                        sentences=[{"text": caption[:second - 1], "char_span": [0, second - 1]},
                                   {"text": caption[second:], "char_span": [second, len(caption)]}],
                        local_pair=[{"sentence_index": 1, "box": [10, 5, 60, 45]}])


def test_goal_and_mulclip_mix_trains_the_temperature_and_leaves_no_parameter_without_gradient(tiny):
    """GOAL's softmax terms train CLIP's logit_scale (docs/methods.md §3.2); MulCLIP's sigmoid terms: own heads.
    In one mix MulCLIP must not freeze the shared scale, and its global head (its terms not named) must not be
    left trainable without a gradient (DDP would wait for it)."""
    terms = {"clip.contrastive": 0, "goal.contrastive": 1.0, "goal.local_contrastive": 0.5, "mulclip.word_patch": 1.0}
    custom = get_method("custom")(terms=terms)
    model = copy.deepcopy(tiny)
    module, loss = custom.build(model), custom.loss()
    ctx = example_context(model)
    batch = collate_examples(custom, [docci_record(i) for i in range(4)], ctx)
    out = loss(module(batch))
    assert set(out) == {"goal.contrastive", "goal.local_contrastive", "mulclip.word_patch"}
    sum(out.values()).backward()
    assert model.clip.logit_scale.requires_grad
    assert model.clip.logit_scale.grad is not None and model.clip.logit_scale.grad.abs() > 0
    without = [n for n, p in module.named_parameters() if p.requires_grad and p.grad is None]
    assert without == []
    assert not any(p.requires_grad for p in module.parts["mulclip"].new_modules.heads["global"].parameters())
    assert all(p.requires_grad for p in module.parts["mulclip"].new_modules.heads["word"].parameters())


def test_a_mix_of_mulclip_terms_only_freezes_the_unused_logit_scale(tiny):
    custom = get_method("custom")(terms={"clip.contrastive": 0, "mulclip.contrastive": 1.0})
    model = copy.deepcopy(tiny)
    module = custom.build(model)
    assert not model.clip.logit_scale.requires_grad
    assert all(p.requires_grad for p in module.parts["mulclip"].new_modules.heads["global"].parameters())


def test_custom_harmoclip_lexeme_region_keeps_its_gradient_out_of_the_text_projection(tiny):
    """The shared-feature memo passes HarmoCLIP's detached token projection through (eqs. 3-4 in a mix too)."""
    custom = get_method("custom")(terms={"clip.contrastive": 0, "harmoclip.lexeme_region": 1.0})
    model = copy.deepcopy(tiny)
    module, loss = custom.build(model), custom.loss()
    batch = collate_examples(FixedNegatives(reversed_and_recoloured).on(custom), [coco_record(i) for i in range(4)],
                             example_context(model))
    out = loss(module(batch))
    out["harmoclip.lexeme_region"].backward()
    grad = model.clip.text_projection.grad
    assert grad is None or not grad.any()
    assert any(p.grad is not None and p.grad.any() for p in model.clip.transformer.parameters())


def test_what_the_planner_asks_a_mix_is_what_its_methods_ask():
    """clipfinetune plan asks a run's method (prepared tables, caption kinds): a mix needs every table of the
    methods whose terms it sums, and GOAL's local pairs only while one of its local terms is summed."""
    mix = get_method("custom")(terms={"degla.distill": 0.005, "harmoclip.global_region": 1.0})
    assert set(mix.prepared_tables()) == {("hard negatives", "negatives"), ("word-region pairs", "word_regions")}
    assert mix.caption_kinds() == {"short"}
    local = get_method("custom")(terms={"clip.contrastive": 0, "goal.tsl_image": 2.0})
    assert local.prepared_tables() == [("local pairs", "lism")] and local.caption_kinds() == {"long"}
    both = get_method("custom")(terms={"goal.tsl_image": 2.0})             # CLIP's contrastive term kept
    assert both.caption_kinds() == {"long", "short"}
    assert get_method("goal")(lambda_local=0.0, lambda_tsl=0.0).prepared_tables() == []     # global-only
    assert get_method("goal")().prepared_tables() == [("local pairs", "lism")]
