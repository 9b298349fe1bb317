"""The suite end to end on a tiny world in the real formats with a stand-in model (DEVELOPERS.md API).

A perfect model (one-hot embeddings by id) must score 100 everywhere; crafted imperfect models check
the hand-computed values of ties, filters and macro averages.
"""
import pytest
from fixtures.eval import world
from fixtures.eval.fakes import FakeModel

from clipfinetune.eval.suite import evaluate_model


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return world.build(tmp_path_factory.mktemp("evalworld"))


def perfect_model():
    return FakeModel(world.perfect_image_vec, world.perfect_text_vec, image_size=32)


def _numbers(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _numbers(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_perfect_model_scores_100_on_every_metric(bench):
    m = evaluate_model(perfect_model(), bench, batch_size=3)
    assert m["skipped"] == {"box_cls_hard": "not configured",
                            "compositionality.aro.sample.flickr_order": "not configured"}
    assert m["meta"]["box_cls_text_encoder"] == "own"
    scores = {k: v for k, v in _numbers(m) if not k.startswith(("skipped", "meta")) and ".n_" not in k
              and not k.split(".")[-1].startswith("n_")}
    expected = {
        *{f"retrieval.sample.{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 10)},
        *{f"long_retrieval.sample.{d}_r{k}" for d in ("i2t", "t2i") for k in (1, 5, 25, 50)},
        "global_local.sample.i2t_map10", "global_local.sample.t2i_map10",
        "box_cls.sample.top1", "box_cls.sample.macc1",
        "compositionality.sugarcrepe.sample.swap_att", "compositionality.sugarcrepe.sample.add_obj",
        "compositionality.sugarcrepe.sample.mean",
        "compositionality.aro.sample.vg_relation", "compositionality.aro.sample.vg_attribution",
        "compositionality.aro.sample.vg_relation_micro", "compositionality.aro.sample.vg_attribution_micro",
        "compositionality.aro.sample.coco_order",
        "compositionality.valse.sample.relations", "compositionality.valse.sample.mean",
        "compositionality.winoground.sample.text", "compositionality.winoground.sample.image",
        "compositionality.winoground.sample.group",
        "zeroshot.sample.acc1", "zeroshot.sample.mean_per_class"}
    for key in expected:
        assert scores[key] == pytest.approx(100.0), key
    # fewer than 5 classes -> no top-5 numbers; global-local as shipped: every query's own pair ties its
    # group partner (same id), and a tied negative ranks first -> AP 1/2 for every query
    assert scores["box_cls.sample.top5"] is None and scores["zeroshot.sample.acc5"] is None
    assert scores["global_local.sample.i2t_map10_as_shipped"] == pytest.approx(50.0)
    assert scores["global_local.sample.t2i_map10_as_shipped"] == pytest.approx(50.0)
    # counts: train image filtered from Karpathy test, DOCCI test only, small + crowd boxes skipped,
    # VALSE keeps 1 of 2, ARO order one case per caption
    assert m["retrieval"]["sample"]["n_images"] == 3 and m["retrieval"]["sample"]["n_captions"] == 6
    assert m["long_retrieval"]["sample"]["n_images"] == 2
    b = m["box_cls"]["sample"]
    assert (b["n_boxes"], b["n_skipped_small_or_huge"], b["n_skipped_crowd"]) == (4, 1, 1)
    assert m["compositionality"]["valse"]["sample"]["n_valid"] == 1
    assert m["compositionality"]["aro"]["sample"]["n_coco_order"] == 6


def test_region_boxes_reach_the_model_in_input_pixels(bench):
    model = perfect_model()
    evaluate_model(model, {"box_cls": bench["box_cls"]})
    boxes = model.seen_region_boxes[0]
    # 48 x 32 image -> 32 x 32 input: x scales by 2/3, y by 1; box [16, 16, 32, 32] (ann 2)
    assert boxes[1].tolist() == pytest.approx([16 * 2 / 3, 16, 32 * 2 / 3, 32])


def test_unconfigured_benchmarks_are_listed_as_skipped():
    m = evaluate_model(perfect_model(), {"retrieval": {"sample": None}, "zeroshot": {}})
    assert m["skipped"]["retrieval.sample"] == "not configured"
    assert m["skipped"]["zeroshot"] == "not configured"
    assert m["skipped"]["long_retrieval"] == "not configured"
    assert "retrieval" not in m


def test_missing_configured_file_is_a_clear_error(bench, tmp_path):
    from clipfinetune.io import InputError
    with pytest.raises((InputError, FileNotFoundError)):
        evaluate_model(perfect_model(), {"zeroshot": {"x": {"dir": str(tmp_path / "nope")}}})


def test_sugarcrepe_tie_counts_wrong(bench):
    # the negative of swap_att record "2" gets the positive's embedding -> tie -> wrong (strict >)
    def text_vec(t):
        return world.perfect_text_vec("id32" if t == "a green box" else t)
    m = evaluate_model(FakeModel(world.perfect_image_vec, text_vec), {"sugarcrepe": bench["sugarcrepe"]})
    sc = m["compositionality"]["sugarcrepe"]["sample"]
    assert sc["swap_att"] == pytest.approx(50.0) and sc["add_obj"] == pytest.approx(100.0)
    assert sc["mean"] == pytest.approx(75.0)         # mean over the files present


def test_box_cls_base_text_encoder_scores_against_another_text_tower(bench):
    # own text tower maps every class prompt to id101 -> only id101 boxes right; base tower is perfect
    bad = FakeModel(world.perfect_image_vec, lambda t: world.perfect_text_vec("id101"))
    own = evaluate_model(bad, {"box_cls": bench["box_cls"]})
    # all 3 class rows tie; a tied wrong class ranks first -> nothing right
    assert own["box_cls"]["sample"]["top1"] == 0.0
    base = evaluate_model(bad, {"box_cls": bench["box_cls"]}, text_model=perfect_model(), text_encoder="base")
    assert base["box_cls"]["sample"]["top1"] == pytest.approx(100.0)
    assert base["meta"]["box_cls_text_encoder"] == "base"


def test_box_cls_mean_per_class_differs_from_overall(bench):
    # class id101 (2 boxes) predicted as id103: prompts of id103 embed like id101's region
    def text_vec(t):
        if "id103" in t:
            return world.perfect_text_vec("id101") * 2
        if "id101" in t:
            return world.perfect_text_vec("id103")
        return world.perfect_text_vec(t)
    m = evaluate_model(FakeModel(world.perfect_image_vec, text_vec), {"box_cls": bench["box_cls"]})["box_cls"]["sample"]
    # boxes: id101 x2 (-> predicted id103: wrong), id102 right, id103 (-> predicted id101: wrong)
    assert m["top1"] == pytest.approx(25.0)
    assert m["macc1"] == pytest.approx(100 / 3)      # per class 0, 1, 0


def test_winoground_text_image_group(bench):
    # example 0: caption_1 also matches image_0 better than caption_0 -> text fails, image ok
    def text_vec(t):
        v = world.perfect_text_vec(t)
        if t == "young id62 kisses old":
            v = v + 2 * world.perfect_text_vec("id61")
        return v
    m = evaluate_model(FakeModel(world.perfect_image_vec, text_vec), {"winoground": bench["winoground"]})
    w = m["compositionality"]["winoground"]["sample"]
    # ex0: c1 = (2 e61 + e62)/sqrt5. text: s(c0,i0)=1 > s(c1,i0)=0.894 and s(c1,i1)=0.447 > s(c0,i1)=0 -> ok;
    # image: s(c1,i1)=0.447 > s(c1,i0)=0.894 fails -> image and group fail for ex0; ex1 perfect
    assert (w["text"], w["image"], w["group"]) == (pytest.approx(100.0), pytest.approx(50.0), pytest.approx(50.0))


def _recomputed_everywhere(model, bench):
    """Every aggregate of `model` recomputed from its per-item outcomes, against the metrics dict."""
    from clipfinetune.eval.items import recompute, to_frame
    found: list = []
    m = evaluate_model(model, bench, batch_size=3, items=found)
    frame = to_frame(found)
    keys = [(k, v) for k, v in _numbers(m) if not k.startswith(("skipped", "meta")) and v is not None
            and not k.split(".")[-1].startswith("n_") and k.split(".")[-1] != "n"]
    assert len(keys) > 30
    for key, value in keys:
        assert recompute(frame, key) == pytest.approx(value, abs=1e-9), key
    return frame


def test_items_recompute_every_aggregate_of_an_imperfect_model(bench):
    # text vectors plus fixed noise per text: some retrieval ranks > 1, some compositional cases wrong
    import zlib

    import numpy as np

    def text_vec(t):
        noise = np.random.default_rng(zlib.crc32(t.encode())).standard_normal(world.DIM).astype(np.float32)
        return world.perfect_text_vec(t) + 0.7 * noise
    frame = _recomputed_everywhere(FakeModel(world.perfect_image_vec, text_vec, image_size=32), bench)
    ranks = frame[frame["kind"] == "rank"]["value"]
    assert ranks.min() >= 1 and (ranks > 1).any()
    assert set(frame["kind"]) == {"rank", "correct", "ap"}
    correct = frame[frame["kind"] == "correct"]["value"]
    assert correct.eq(0).any() and correct.eq(1).any()


def test_items_have_unique_stable_ids_that_pair_two_models(bench):
    frame_a = _recomputed_everywhere(perfect_model(), bench)
    found: list = []
    evaluate_model(FakeModel(world.perfect_image_vec, lambda t: world.perfect_text_vec("id101")), bench,
                   batch_size=3, items=found)
    from clipfinetune.eval.items import to_frame
    frame_b = to_frame(found)
    key = ["benchmark", "part", "item"]
    assert not frame_a.duplicated(key).any()
    assert frame_a[key].sort_values(key).reset_index(drop=True).equals(
        frame_b[key].sort_values(key).reset_index(drop=True))
    sc = frame_a[frame_a["benchmark"] == "compositionality.sugarcrepe.sample"]
    assert set(sc["part"]) == {"swap_att", "add_obj"} and sc["value"].eq(1.0).all()


# ---- per-protocol resize (issue #24): open_clip's short side + centre crop, FineCLIP's squash for boxes
def test_each_benchmark_gets_its_protocols_resize(bench, monkeypatch):
    from clipfinetune.eval import suite

    seen = {}
    monkeypatch.setattr(suite, "run_benchmark",
                        lambda task, cfg, enc, *a, **k: seen.setdefault(task, enc.resize_mode) and {})
    evaluate_model(perfect_model(), dict(bench, box_cls_hard=bench["box_cls"]))
    squash = {"box_cls", "box_cls_hard"}
    assert seen == {task: "squash" if task in squash else "shortest" for task in suite.TASKS}


def test_shortest_and_squash_differ_on_non_square_images_and_match_torchvision(tmp_path):
    import torch
    from fixtures.methods import random_image, tiny_model
    from torchvision import transforms as T

    from clipfinetune.eval.encode import Encoder

    model = tiny_model()
    s, cfg = model.image_size, model.preprocess_cfg
    wide = random_image(3, 3 * s, s)                       # non-square: the crop keeps the middle third
    by_hand = T.Compose([T.Resize(s, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(s), T.ToTensor(),
                         T.Normalize(cfg["mean"], cfg["std"])])(wide)
    torch.testing.assert_close(model.eval_transform("shortest")(wide), by_hand)
    assert not torch.allclose(model.eval_transform("squash")(wide), by_hand, atol=1e-2)
    wide.save(tmp_path / "wide.png")
    square = random_image(4, 2 * s, 2 * s)
    square.save(tmp_path / "square.png")
    enc = Encoder(model, 4)
    keys = [(str(tmp_path / "wide.png"), None), (str(tmp_path / "square.png"), None)]
    squashed, cropped = enc.images(keys), enc.with_resize("shortest").images(keys)
    assert not torch.allclose(squashed[0], cropped[0], atol=1e-4)
    assert torch.equal(squashed[1], cropped[1])            # square: both protocols give the same embedding


def test_square_world_metrics_unchanged_by_protocol_resize(bench, monkeypatch):
    """On square images (this fixture world, as the sample world's whole images) every metric equals the all-squash
    evaluation's (the sample world's ARO box crops are not square; the official protocol centre-crops them)."""
    from fixtures.methods import tiny_model

    from clipfinetune.eval import encode

    model = tiny_model()
    protocol = evaluate_model(model, bench, batch_size=4)
    monkeypatch.setattr(encode, "PROTOCOL_RESIZE", dict.fromkeys(encode.PROTOCOL_RESIZE, "squash"))
    monkeypatch.setattr("clipfinetune.eval.suite.PROTOCOL_RESIZE", encode.PROTOCOL_RESIZE)
    assert evaluate_model(model, bench, batch_size=4) == protocol
