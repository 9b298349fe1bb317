"""The `custom` loss mix (issue 14): the mix equals the weighted sum of each method's own terms on the same batch
(values and gradients), shared image features are computed once, term parsing."""
from __future__ import annotations

import copy

import pytest
import torch
from fixtures.methods import FixedNegativesContext, collate_examples, shard_record, tiny_model

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
    return shard_record(
        str(i), "coco", W, H,
        captions=[f"a red circle beside {i} green squares", f"a blue star above a yellow ring number {i}"],
        word_regions=[{"caption_index": 0, "word": "circle", "char_span": [6, 12],
                       "box": [10, 20, 60, 70], "category": "circle"}],
        negatives=[{"caption_index": 1, "type": "replace_nouns", "texts": [f"a blue ring above a star {i}"]},
                   {"caption_index": 1, "type": "reshuffle",
                    "texts": [f"a yellow star above a blue ring {i}"]}])


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
    batch = collate_examples(custom, records, FixedNegativesContext(model, reversed_and_recoloured))

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
