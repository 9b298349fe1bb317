"""The binding oracle probe (research/binding_oracle.py, issue 35): its negatives are false by the scene truth, its
loss is NegCLIP's, its batches follow the variant. The probe's whole run is tests/scale/test_binding_oracle_run.py."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from clipfinetune.sample.scene import OPPOSITE, holds
from clipfinetune.sample.vocab import COLOUR_NAMES, RELATIONS, SHAPE_NAMES
from clipfinetune.sample.world import WorldConfig, generate_world
from research.binding_oracle import (
    NegClipLoss,
    ProbeSource,
    binding_pairs,
    read_scenes,
    same_bag_pairs,
)

PHRASE_TO_REL = {p: r for r, phrases in RELATIONS.items() for p in phrases}
NP = re.compile(rf"\b({'|'.join(COLOUR_NAMES)}) ({'|'.join(SHAPE_NAMES)})\b")


@pytest.fixture(scope="module")
def train_scenes(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    generate_world(root, WorldConfig(n_train=60, n_val=4, n_docci_train=2, n_docci_test=2, n_compositional=2,
                                     n_zeroshot_per_class=1))
    return list(read_scenes(root, "train").values())


def truth(text: str, scene) -> bool:
    """Is a caption of the form "... <colour shape> [<relation>|and] <colour shape>." true of the scene?"""
    named = NP.findall(text.lower())
    objs = {o.key: o for o in scene.objects}
    if any(k not in objs for k in named):
        return False
    between = text.lower().split(" ".join(named[0]))[1].split(" ".join(named[1]))[0]
    between = " ".join(w for w in between.split() if w not in ("a", "an", "is"))     # "is under a" -> "under"
    for phrase in sorted(PHRASE_TO_REL, key=len, reverse=True):
        if between.endswith(phrase):
            return holds(PHRASE_TO_REL[phrase], objs[named[0]], objs[named[1]], scene.size)
    return between.endswith("and")


def test_every_oracle_negative_is_false_and_its_caption_true(train_scenes):
    made = 0
    for i, scene in enumerate(train_scenes):
        for caption, negative in binding_pairs(scene, seed=i):
            made += 1
            assert truth(caption, scene), (caption, scene)
            assert not truth(negative, scene), (negative, scene)
            # the same words, re-bound: a swap, never a new word
            assert sorted(re.findall("[a-z]+", caption.lower())) == sorted(re.findall("[a-z]+", negative.lower()))
    assert made >= len(train_scenes)        # most 2-4-object scenes give several


def test_relation_truth_helper_is_not_trivial(train_scenes):
    found = [(s, a, b, r) for s in train_scenes if len({o.key for o in s.objects}) == len(s.objects)
             for a in s.objects for b in s.objects if a is not b for r in OPPOSITE if holds(r, a, b, s.size)]
    assert found
    scene, a, b, rel = found[0]
    text = f"A {a.colour} {a.shape} {RELATIONS[rel][0]} a {b.colour} {b.shape}."
    assert truth(text, scene)
    assert not truth(f"A {b.colour} {b.shape} {RELATIONS[rel][0]} a {a.colour} {a.shape}.", scene)
    assert not truth(f"A {b.colour} {a.shape} {RELATIONS[rel][0]} a {a.colour} {b.shape}.", scene)


def test_negclip_loss_matches_a_float64_reference():
    g = torch.Generator().manual_seed(0)
    image, text, neg = (torch.nn.functional.normalize(torch.randn(5, 8, generator=g), dim=1) for _ in range(3))
    valid = torch.tensor([True, False, True, True, False])
    scale = torch.tensor(7.0)
    got = NegClipLoss(negatives=True)({"image": image, "text": text, "neg_text": neg, "neg_valid": valid,
                                       "logit_scale": scale})["contrastive"]
    im, tx, ng = (x.double().numpy() for x in (image, text, neg))
    total = 0.0
    for i in range(5):     # image i against every caption and every VALID negative of the batch
        logits = [7.0 * im[i] @ tx[j] for j in range(5)] + [7.0 * im[i] @ ng[j] for j in range(5) if valid[j]]
        total += -(logits[i] - np.log(np.exp(logits).sum())) / 5 / 2
        col = [7.0 * tx[i] @ im[j] for j in range(5)]          # caption i against every image
        total += -(col[i] - np.log(np.exp(col).sum())) / 5 / 2
    assert float(got) == pytest.approx(total, rel=1e-5)
    pair = NegClipLoss(negatives=True, pair_weight=0.5)({"image": image, "text": text, "neg_text": neg,
                                                         "neg_valid": valid, "logit_scale": scale})
    ref = [-np.log(1 / (1 + np.exp(7.0 * im[i] @ ng[i] - 7.0 * im[i] @ tx[i]))) for i in range(5) if valid[i]]
    assert float(pair["pair"]) == pytest.approx(0.5 * np.mean(ref), rel=1e-5)
    assert float(pair["contrastive"]) == pytest.approx(total, rel=1e-5)
    plain = NegClipLoss(negatives=False)({"image": image, "text": text, "neg_text": neg, "neg_valid": valid,
                                          "logit_scale": scale})["contrastive"]
    assert float(plain) < float(got)        # hard negatives only add mass to the denominators


def test_probe_source_draws_binding_pairs_only_in_the_binding_variants(train_scenes):
    tokenize = lambda texts: torch.tensor([[hash(t) % 1000, len(t)] for t in texts])
    captions = [[f"caption {i}"] for i in range(len(train_scenes))]
    pairs = [binding_pairs(sc, seed=i) for i, sc in enumerate(train_scenes)]
    images = torch.zeros(len(train_scenes), 3, 4, 4, dtype=torch.uint8)
    oracle = ProbeSource(images, lambda x: x.float(), captions, pairs, tokenize, 8, seed=0, binding_share=0.5)
    clip = ProbeSource(images, lambda x: x.float(), captions, [[] for _ in pairs], tokenize, 8, 0, 0.5)
    a, b = list(oracle.batches(0)), list(oracle.batches(0))
    assert len(a) == len(train_scenes) // 8 and all(torch.equal(x["text"], y["text"]) for x, y in zip(a, b))
    share = torch.cat([x["neg_valid"] for x in a]).float().mean()
    assert 0.25 < share < 0.75                   # about half the images, where the scene has a pair
    assert not any(x["neg_valid"].any() for x in clip.batches(0))
    assert next(iter(oracle.batches(0, start=2)))["text"].equal(a[2]["text"])    # a later start: the same batches


def test_same_bag_pairs_counts_rebound_partners(train_scenes):
    from clipfinetune.sample.scene import Obj, Scene

    def scene(*objs):
        return Scene("x", 64, "black", [Obj(s, c, "small", (0, 0, 0), 0, 0, 1, 0) for c, s in objs])

    scenes = [scene(("red", "star"), ("blue", "ring")), scene(("blue", "star"), ("red", "ring")),
              scene(("red", "star"), ("blue", "ring")), scene(("red", "star"), ("green", "ring"))]
    assert same_bag_pairs(scenes) == (3, 2)      # images 0, 1, 2 share a bag; 1 is bound differently from 0 and 2
    assert json.dumps(same_bag_pairs(train_scenes))      # a plain pair of ints


def test_a_probe_trains_with_the_resolved_settings_of_its_methods_run():
    """The probes (binding_oracle: the clip run; fig2/gpu: each method's own run) take a run's settings from
    clipfinetune/runs.py, as train@<run> does: the shared training settings with the method's group, its weights from
    `loss`; no run of the method is an error, not a default."""
    from benchmarks.common import method_run

    shared = {"epochs": 2, "batch_size": 64, "lr": 2e-4, "warmup": 10, "seed": 0}
    params = {"loss": {"lambda_g": 0.5, "lambda_l": 0.2, "focal_gamma": 2.0, "label_smoothing": 0.02},
              "runs": {"baseline": {"method": "clip"}, "fsc_lhn_only": {"method": "fsc_clip", "lambda_g": 0.0},
                       "fsc_clip": {"method": "fsc_clip"}},
              "train": {**shared, "keep_checkpoint": False, "clip": {"lr": 1e-4}, "fsc_clip": {"lr": 5e-6}},
              "model": {"precision": "auto"}}
    assert method_run(params, "clip")["train"] == {**shared, "lr": 1e-4}          # the first (here: only) clip run
    fsc = method_run(params, "fsc_clip")                                          # the run named as the method
    assert fsc["train"] == {**shared, "lr": 5e-6} and fsc["config"]["lambda_g"] == 0.5
    assert fsc["config"]["lambda_l"] == 0.2 and fsc["precision"] == "auto"
    with pytest.raises(ValueError, match="no run of method 'goal'"):
        method_run(params, "goal")