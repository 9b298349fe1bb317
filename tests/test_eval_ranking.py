"""Rank metrics against hand-computed values through the evaluators' own path (an encoder whose embeddings give a
chosen score table): min-rank recall, the tie rule, top-k, mAcc, GOAL AP@k."""
import numpy as np
import pytest
import torch

from clipfinetune.data.evalsets.global_local import JointRecord
from clipfinetune.data.evalsets.retrieval import RetrievalSet
from clipfinetune.eval.box_cls import box_metrics
from clipfinetune.eval.global_local import evaluate_global_local
from clipfinetune.eval.ranking import average_precision_at_k, mean_per_class, negatives_ahead, topk_hits
from clipfinetune.eval.retrieval import evaluate_retrieval
from clipfinetune.eval.zeroshot import zeroshot_metrics


class TableEncoder:
    """The `Encoder` interface with fixed embeddings: image i is the i-th unit vector and text j the j-th column of
    `scores` [images, texts], so the evaluator's image @ text similarities are exactly `scores`."""

    def __init__(self, scores, images: list, texts: list[str]):
        scores = torch.as_tensor(np.asarray(scores), dtype=torch.float32)
        self.image_rows = {key: torch.eye(len(images))[i] for i, key in enumerate(images)}
        self.text_rows = {text: scores[:, j] for j, text in enumerate(texts)}

    def images(self, keys):
        return torch.stack([self.image_rows[tuple(k) if isinstance(k, (tuple, list)) else k] for k in keys])

    def texts(self, texts):
        return torch.stack([self.text_rows[t] for t in texts])


def test_i2t_uses_min_rank_over_ground_truth_captions():
    # captions 0,1 -> image 0; caption 2 -> image 1
    s = np.array([[0.1, 0.9, 0.5],
                  [0.8, 0.7, 0.6]], dtype=np.float32)
    data = RetrievalSet(["i0", "i1"], ["c0", "c1", "c2"], [0, 0, 1])
    m = evaluate_retrieval(TableEncoder(s, [("i0", None), ("i1", None)], data.captions), data, ks=(1, 2, 5))
    # image 0: best GT caption (0.9) is first -> hit@1; image 1: its caption 0.6 has 2 negatives above
    assert m["i2t_r1"] == pytest.approx(50.0)
    assert m["i2t_r2"] == pytest.approx(50.0)
    assert m["i2t_r5"] == pytest.approx(100.0)
    # t2i: caption 0 -> image 0 scores 0.1 < 0.8 (miss@1); caption 1: 0.9 > 0.7; caption 2: 0.6 > 0.5
    assert m["t2i_r1"] == pytest.approx(200.0 / 3)
    assert m["t2i_r2"] == pytest.approx(100.0)


def test_tied_negative_counts_against_the_query_and_order_does_not_matter():
    pos = np.array([[True, False, False]])
    s = np.array([[0.5, 0.5, 0.2]])
    assert negatives_ahead(s, pos).tolist() == [1]                 # a miss at 1, a hit at 2
    assert negatives_ahead(s[:, ::-1], pos[:, ::-1]).tolist() == [1]
    # ties among positives do not hurt
    assert negatives_ahead(np.array([[0.5, 0.5, 0.4]]), np.array([[True, True, False]])).tolist() == [0]
    # a constant model scores 0, not 100: every query has its negatives ahead
    assert negatives_ahead(np.ones((3, 3)), np.eye(3, dtype=bool)).tolist() == [2, 2, 2]
    # ... through the evaluator: three images, one caption each, every similarity equal
    data = RetrievalSet(["i0", "i1", "i2"], ["c0", "c1", "c2"], [0, 1, 2])
    m = evaluate_retrieval(TableEncoder(np.ones((3, 3)), [(p, None) for p in data.images], data.captions), data)
    assert m["i2t_r1"] == m["t2i_r1"] == 0.0 and m["i2t_r5"] == 100.0


def test_query_without_positive_is_an_error():
    with pytest.raises(ValueError):
        negatives_ahead(np.zeros((1, 2)), np.zeros((1, 2), dtype=bool))


def test_top1_overall_vs_mean_per_class():
    logits = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    labels = np.array([0, 0, 0, 1])
    hits = topk_hits(logits, labels, 1)
    assert hits.tolist() == [True, True, True, False]
    assert mean_per_class(hits, labels) == pytest.approx(50.0)      # (3/3 + 0/1) / 2
    m = box_metrics(logits, labels)
    assert m["top1"] == pytest.approx(75.0) and m["macc1"] == pytest.approx(50.0)
    assert m["top5"] is None and m["macc5"] is None                  # fewer than 5 classes


def test_top5_with_six_classes_and_a_tie_at_the_boundary():
    # label 0 scores 0.5; four wrong classes above and one tied -> 5 wrong at >= 0.5 -> miss@5
    logits = np.array([[0.5, 0.9, 0.8, 0.7, 0.6, 0.5],
                       [0.5, 0.9, 0.8, 0.7, 0.6, 0.4]])
    labels = np.array([0, 0])
    assert topk_hits(logits, labels, 5).tolist() == [False, True]
    z = zeroshot_metrics(logits, labels)
    assert z["acc1"] == 0.0 and z["acc5"] == pytest.approx(50.0) and z["mean_per_class"] == 0.0


def test_zeroshot_mean_per_class_is_balanced_accuracy():
    logits = np.array([[1, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]], dtype=float)
    labels = np.array([0, 0, 1, 2, 2])
    z = zeroshot_metrics(logits, labels)
    assert z["acc1"] == pytest.approx(80.0)
    assert z["mean_per_class"] == pytest.approx(100 * (1 + 1 + 0.5) / 3)
    assert z["acc5"] is None


def test_goal_ap_examples_from_benchmarks_7_3():
    # records [G1, G2, L1, L2]; query G1 relevant {T_G1, T_L1} = columns {0, 2}
    rel = np.array([[True, False, True, False]])
    assert average_precision_at_k(np.array([[0.9, 0.1, 0.8, 0.2]]), rel, 10)[0] == pytest.approx(1.0)
    # ranking [T_G2, T_G1, T_L2, T_L1]
    assert average_precision_at_k(np.array([[0.8, 0.9, 0.2, 0.7]]), rel, 10)[0] == pytest.approx(0.5)
    # normalised by |rel| even when k cuts the list: only the first hit inside k=2
    assert average_precision_at_k(np.array([[0.8, 0.9, 0.2, 0.7]]), rel, 2)[0] == pytest.approx(0.25)


def test_global_local_map_linked_vs_as_shipped():
    recs = [JointRecord(("g1", None), "g1", "a", False), JointRecord(("g2", None), "g2", "b", False),
            JointRecord(("l1", None), "l1", "a", True), JointRecord(("l2", None), "l2", "b", True)]
    s = np.array([[0.9, 0.1, 0.8, 0.2],
                  [0.9, 0.8, 0.2, 0.7],
                  [0.3, 0.4, 0.5, 0.6],
                  [0.0, 0.5, 0.4, 0.3]])
    m = evaluate_global_local(TableEncoder(s, [r.image for r in recs], [r.caption for r in recs]), recs)
    # I2T per query (hand ranking): linked 1, (1/2+2/3)/2, (1/2+2/4)/2, (1+2/3)/2; shipped 1, 1/2, 1/2, 1/3
    assert m["i2t_map10"] == pytest.approx(100 * (1 + 7 / 12 + 0.5 + 5 / 6) / 4)
    assert m["i2t_map10_as_shipped"] == pytest.approx(100 * (1 + 0.5 + 0.5 + 1 / 3) / 4)
    # T2I: column g1 has a tie 0.9/0.9 between image G1 (relevant) and G2 -> G2 ranked first
    assert m["t2i_map10"] == pytest.approx(100 * ((1 / 2 + 2 / 3) / 2 + 1 + 1 + 5 / 6) / 4)
    assert m["t2i_map10_as_shipped"] == pytest.approx(100 * (0.5 + 1 + 0.5 + 1 / 3) / 4)
    assert m["n_records"] == 4 and m["n_local"] == 2
