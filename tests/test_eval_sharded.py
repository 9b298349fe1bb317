"""The evaluation's encoding as planned units (clipfinetune/eval/sharded.py): a suite scored from units computed
in any split, with images decoded in DataLoader workers, equals the lazily encoding suite bit for bit (CPU)."""
from __future__ import annotations

import json
import logging

import numpy as np
import torch
from PIL import Image

from clipfinetune.eval import sharded
from clipfinetune.eval.items import to_frame
from clipfinetune.eval.suite import evaluate_model, make_encoders
from clipfinetune.parts import units_of_rank


def _zeroshot_set(root):
    rng = np.random.default_rng(0)
    for c, colour in enumerate(((220, 30, 30), (30, 30, 220), (30, 200, 30))):
        (root / "test" / f"class{c}").mkdir(parents=True)
        for k in range(3):
            img = np.full((40, 56, 3), 90, np.uint8)
            img[5 + k:25, 8:30 + k] = colour
            Image.fromarray(np.clip(img + rng.integers(0, 30, img.shape), 0, 255).astype(np.uint8)).save(
                root / "test" / f"class{c}" / f"{k}.png")
    (root / "classnames.txt").write_text("red square\nblue square\ngreen square\n")
    return {"zeroshot": {"shapes": {"dir": str(root), "split": "test"}}}


def test_units_computed_in_any_split_with_workers_score_as_the_lazy_suite(tmp_path, caplog):
    from clipfinetune.models import load_model

    torch.manual_seed(0)
    model = load_model("cft-tiny-vit").eval()
    evalsets = _zeroshot_set(tmp_path / "shapes")
    lazy_items: list = []
    lazy = evaluate_model(model, evalsets, batch_size=4, items=lazy_items)

    with caplog.at_level(logging.INFO):
        plan = sharded.plan_batches(model, evalsets, batch_size=4)
    # the planning pass scores placeholder vectors: its chance-level numbers must not reach the log
    assert not [r for r in caplog.records if "zeroshot.shapes" in r.getMessage()]
    kinds = [u["kind"] for u in plan]
    assert kinds.count("images") == 3 and "texts" in kinds        # 9 images at 4 per batch, then the prompts
    encoders = make_encoders(model, batch_size=4)
    by_tag = {"model": encoders[0], "text_model": encoders[1]}
    results = [None] * len(plan)
    for rank in range(2):                 # two "ranks", the second decoding in 2 DataLoader workers
        mine = units_of_rank(len(plan), rank, 2)
        for i, res in sharded.encode_units([plan[k] for k in mine], by_tag, workers=2 * rank):
            results[mine[i]] = res
    sharded.fill_encoders(plan, results, by_tag)
    calls = []
    encode_image = model.encode_image
    model.encode_image = lambda *a, **k: (calls.append(1), encode_image(*a, **k))[1]
    items: list = []
    with caplog.at_level(logging.INFO):
        got = evaluate_model(model, evalsets, batch_size=4, items=items, encoders=encoders)
    logged = [r.getMessage() for r in caplog.records if "zeroshot.shapes" in r.getMessage()]
    assert len(logged) == 1 and f"'acc1': {round(got['zeroshot']['shapes']['acc1'], 2)}" in logged[0]
    assert calls == [], "the scoring pass encoded images itself"
    assert json.dumps(got, sort_keys=True) == json.dumps(lazy, sort_keys=True)
    assert to_frame(items).equals(to_frame(lazy_items))
