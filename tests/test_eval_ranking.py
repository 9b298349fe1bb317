"""Rank metrics against hand-computed values: min-rank recall, the tie rule, top-k, mAcc, GOAL AP@k."""
import numpy as np
import pytest
import torch

from clipfinetune.eval.box_cls import box_metrics
from clipfinetune.eval.global_local import JointRecord, map_at_k
from clipfinetune.eval.ranking import average_precision_at_k, mean_per_class, recall_at_k, topk_hits
from clipfinetune.eval.retrieval import retrieval_metrics
from clipfinetune.eval.zeroshot import zeroshot_metrics


def test_i2t_uses_min_rank_over_ground_truth_captions():
    # captions 0,1 -> image 0; caption 2 -> image 1
    s = np.array([[0.1, 0.9, 0.5],
                  [0.8, 0.7, 0.6]], dtype=np.float32)
    # drive retrieval_metrics through embeddings whose dot products are exactly s
    img = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    txt = torch.tensor(s.T)                               # [3, 2]: text j = (s[0, j], s[1, j])
    m = retrieval_metrics(img, txt, [0, 0, 1], ks=(1, 2, 5))
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
    assert recall_at_k(s, pos, [1, 2]) == {1: 0.0, 2: 100.0}
    assert recall_at_k(s[:, ::-1], pos[:, ::-1], [1, 2]) == {1: 0.0, 2: 100.0}
    # ties among positives do not hurt
    assert recall_at_k(np.array([[0.5, 0.5, 0.4]]), np.array([[True, True, False]]), [1]) == {1: 100.0}
    # a constant model scores 0, not 100
    assert recall_at_k(np.ones((3, 3)), np.eye(3, dtype=bool), [1]) == {1: 0.0}


def test_query_without_positive_is_an_error():
    with pytest.raises(ValueError):
        recall_at_k(np.zeros((1, 2)), np.zeros((1, 2), dtype=bool), [1])


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
    linked = map_at_k(s, recs, "linked", 10)
    shipped = map_at_k(s, recs, "as_shipped", 10)
    # I2T per query (hand ranking): linked 1, (1/2+2/3)/2, (1/2+2/4)/2, (1+2/3)/2; shipped 1, 1/2, 1/2, 1/3
    assert linked["i2t"] == pytest.approx(100 * (1 + 7 / 12 + 0.5 + 5 / 6) / 4)
    assert shipped["i2t"] == pytest.approx(100 * (1 + 0.5 + 0.5 + 1 / 3) / 4)
    # T2I: column g1 has a tie 0.9/0.9 between image G1 (relevant) and G2 -> G2 ranked first
    assert linked["t2i"] == pytest.approx(100 * ((1 / 2 + 2 / 3) / 2 + 1 + 1 + 5 / 6) / 4)
    assert shipped["t2i"] == pytest.approx(100 * (0.5 + 1 + 0.5 + 1 / 3) / 4)
