"""GOAL's LISM step 2: match each sentence of a long caption to an image region (METHODS §3.1).

For an image, the candidates are the global image (candidate 0) and the crops of its segments; every
sentence goes to its most similar candidate (cosine of CLIP embeddings; GOAL scores `logits_per_image`,
i.e. 100 x cosine, which has the same argmax). Decisions, following GOAL's code where it exists:
- training pairs: sentences whose best candidate is the global image are removed (GOAL's `*_del_org`
  jsons); of the rest, the image keeps its single highest-scoring (sentence, region) pair, fixed for all
  epochs. An image all of whose sentences prefer the global image has no local pair ("the global image
  wins") and trains on L_global only.
- test pairs (GOAL's joint test list): the single highest-scoring pair over all sentences, and if that
  candidate is the global image the local item is the global image itself (as 211/1,999 of GOAL's are).
- every per-sentence match is kept in the output for analysis (`chosen` marks the training pair).
- over-long sentences are truncated by the tokenizer (GOAL's code skips the whole image instead).
Boxes are known (segments.parquet), so no template matching is needed to recover them.

Reproducibility: the scores are written to disk, so their float bits must depend on the inputs and params only.
Each image is encoded on its own, in batches fixed by its candidate and sentence counts and `batch_size`, and
the forwards run with ONE torch intra-op thread (`fixed_threads`): a GEMM's or convolution's summation order
depends on how many threads split it, and a re-run under another thread count (`OMP_NUM_THREADS`,
`torch.set_num_threads`, MKL's dynamic threading on a busy machine) would otherwise change low bits of the
scores, which the parquet keeps. The cost: no intra-op parallelism in LISM's CPU forwards.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SentenceMatch:
    sentence_index: int
    candidate: int      # 0 = global image, r >= 1 = segment r-1
    score: float        # 100 x cosine


def match_sentences(sentence_emb: torch.Tensor, candidate_emb: torch.Tensor) -> list[SentenceMatch]:
    """Each sentence -> argmax over [global, *segments] of 100 x cosine (embeddings L2-normalised)."""
    scores = 100.0 * sentence_emb.float() @ candidate_emb.float().T      # [S, 1+R]
    best = scores.argmax(dim=1)
    return [SentenceMatch(i, int(c), float(scores[i, c])) for i, c in enumerate(best.tolist())]


def choose_training_pair(matches: list[SentenceMatch]) -> SentenceMatch | None:
    """Best region match after removing sentences won by the global image; None if all were."""
    regional = [m for m in matches if m.candidate > 0]
    return max(regional, key=lambda m: (m.score, -m.sentence_index)) if regional else None


def choose_test_pair(matches: list[SentenceMatch]) -> SentenceMatch:
    """The single best (sentence, candidate) pair, the global image included."""
    return max(matches, key=lambda m: (m.score, -m.sentence_index))


@torch.inference_mode()
def embed_images(model, pil_images: list, batch_size: int) -> torch.Tensor:
    out = []
    for i in range(0, len(pil_images), batch_size):
        batch = torch.stack([model.transform(im) for im in pil_images[i:i + batch_size]])
        out.append(model.encode_image(batch, normalize=True))
    return torch.cat(out) if out else torch.empty(0)


@torch.inference_mode()
def embed_texts(model, texts: list[str], batch_size: int) -> torch.Tensor:
    out = []
    for i in range(0, len(texts), batch_size):
        out.append(model.encode_text(model.tokenize(texts[i:i + batch_size]), normalize=True))
    return torch.cat(out) if out else torch.empty(0)


LISM_THREADS = 1   # see the module docstring: the forwards' float bits must not depend on the caller's threads


@contextlib.contextmanager
def fixed_threads(n: int = LISM_THREADS):
    """torch's intra-op thread count set to `n` inside the block, the caller's restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def match_image(model, image, sentences: list[str], boxes: list[tuple], batch_size: int = 64):
    """Candidates (global + crops with background) and per-sentence matches for one PIL image."""
    crops = [image.crop(tuple(round(v) for v in box)) for box in boxes]
    with fixed_threads():
        candidate_emb = embed_images(model, [image, *crops], batch_size)
        sentence_emb = embed_texts(model, sentences, batch_size)
        return match_sentences(sentence_emb, candidate_emb)


def box_iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def measure_against_ground_truth(rows, truth: dict, n_images: int, iou_threshold: float = 0.5) -> dict:
    """LISM accuracy vs the sample world's sentence -> object boxes.

    rows: dicts with image_id, sentence, kind ('region'|'global'), box, chosen.
    truth: {(image_id, sentence text): box} for sentences that describe one object.
    accuracy: % of chosen pairs whose box has IoU >= threshold with the described object's box;
    coverage: % of images with a chosen pair; sentence_accuracy: % of object sentences whose own best
    candidate is a region with IoU >= threshold.
    """
    chosen = [r for r in rows if r["chosen"]]
    # A chosen sentence that describes no object (the summary, the background) counts as wrong.
    chosen_ok = [(r["image_id"], r["sentence"]) in truth
                 and box_iou(r["box"], truth[(r["image_id"], r["sentence"])]) >= iou_threshold for r in chosen]
    sentence_ok = [r["kind"] == "region" and box_iou(r["box"], truth[(r["image_id"], r["sentence"])]) >= iou_threshold
                   for r in rows if (r["image_id"], r["sentence"]) in truth]
    pct = lambda xs: round(100.0 * float(np.mean(xs)), 2) if xs else 0.0
    return {"accuracy": pct(chosen_ok), "coverage": round(100.0 * len(chosen) / max(n_images, 1), 2),
            "sentence_accuracy": pct(sentence_ok), "n_images": n_images, "n_chosen": len(chosen),
            "n_truth_sentences": len(sentence_ok)}
