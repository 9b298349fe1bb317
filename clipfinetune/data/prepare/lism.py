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

On a GPU (`match_images` with the model on CUDA) the candidates and sentences of all the images of a work unit
are encoded together, `batch_size` per forward, so the crops of many images share a forward. A GPU run
guarantees the same matching rule and the same outputs' schema and ordering; its scores are the GPU's fp32
float bits, which depend on the kernels cuBLAS/cuDNN pick for each batch shape, so they can differ from the CPU's
(and between GPU models or library versions) in low bits, and an argmax between near-ties may flip. A re-run on
the same GPU, software and unit size computes the same batches; it is not promised bit for bit (the parts of an
interrupted run are reused as they are).

The stage's loop is split for ranks and resume (stages/lism.py, clipfinetune/parts.py): `lism_unit` matches the
images of one work unit (a JSON-able result per image), and `assemble_lism` turns every image's result, in image
order, into the stage's rows, test items and counts: the same whichever rank matched an image.
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


def model_device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


@torch.inference_mode()
def embed_images(model, pil_images: list, batch_size: int) -> torch.Tensor:
    out, device = [], model_device(model)
    for i in range(0, len(pil_images), batch_size):
        batch = torch.stack([model.transform(im) for im in pil_images[i:i + batch_size]])
        out.append(model.encode_image(batch.to(device, non_blocking=True), normalize=True).float().cpu())
    return torch.cat(out) if out else torch.empty(0)


@torch.inference_mode()
def embed_texts(model, texts: list[str], batch_size: int) -> torch.Tensor:
    out, device = [], model_device(model)
    for i in range(0, len(texts), batch_size):
        tokens = model.tokenize(texts[i:i + batch_size]).to(device, non_blocking=True)
        out.append(model.encode_text(tokens, normalize=True).float().cpu())
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


def match_images(model, jobs: list[tuple], batch_size: int = 64,
                 shared_batches: bool | None = None) -> list[list[SentenceMatch]]:
    """`match_image` for each (PIL image, sentences, boxes) of `jobs`. By default on the CPU one image at a time
    (the byte-identical path), on a GPU every candidate and sentence of `jobs` in shared batches (module
    docstring); `shared_batches` forces either."""
    if shared_batches is None:
        shared_batches = model_device(model).type != "cpu"
    if not shared_batches:
        return [match_image(model, image, texts, boxes, batch_size) for image, texts, boxes in jobs]
    candidates = [[image, *(image.crop(tuple(round(v) for v in box)) for box in boxes)] for image, _, boxes in jobs]
    candidate_emb = embed_images(model, [c for cs in candidates for c in cs], batch_size)
    sentence_emb = embed_texts(model, [t for _, texts, _ in jobs for t in texts], batch_size)
    out, ci, si = [], 0, 0
    for cs, (_, texts, _) in zip(candidates, jobs):
        out.append(match_sentences(sentence_emb[si:si + len(texts)], candidate_emb[ci:ci + len(cs)]))
        ci, si = ci + len(cs), si + len(texts)
    return out


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


# ------------------------------------------------------------------------------------------ the stage's loop
TRAIN_SPLIT, TEST_SPLIT = "train", "test"   # DOCCI's qual_dev / qual_test: neither trained on nor listed (counted)


def _split(record) -> str:
    return record.split or TRAIN_SPLIT       # a format without splits is training data


def lism_unit(records, by_image: dict, boxes_of: dict, model, batch_size: int) -> list[dict]:
    """Match every train/test image of `records` (one work unit) -> one JSON-able result per record: {"split"}
    for another split, {"skip", "file"?} when it has no sentences or cannot be read, else {"size": [w, h],
    "matches": [[sentence position, candidate, score], ...]}. `by_image`/`boxes_of`: `lism_inputs`."""
    from clipfinetune.io import InputError

    results, jobs, slots = [], [], []
    for record in records:
        image_id, split = record.image_id, _split(record)
        if split not in (TRAIN_SPLIT, TEST_SPLIT):
            results.append({"split": split})
        elif image_id not in by_image:
            results.append({"skip": "no sentences"})
        else:
            try:
                image = record.read_image()
            except InputError as e:
                results.append({"skip": str(e), "file": str(record.path)})
                continue
            results.append({"size": [image.width, image.height]})
            jobs.append((image, by_image[image_id]["text"].tolist(), boxes_of.get(image_id, [])))
            slots.append(len(results) - 1)
    for slot, matches in zip(slots, match_images(model, jobs, batch_size)):
        results[slot]["matches"] = [[m.sentence_index, m.candidate, m.score] for m in matches]
    return results


def lism_inputs(sentences, segments) -> tuple[dict, dict]:
    """({image_id: its sentences in order}, {image_id: its segment boxes}) from sentences/segments.parquet."""
    by_image = {k: g.sort_values("sentence_index") for k, g in sentences.groupby("image_id")}
    boxes_of = {k: [tuple(r) for r in g[["x0", "y0", "x1", "y1"]].itertuples(index=False)]
                for k, g in segments.groupby("image_id")}
    return by_image, boxes_of


def assemble_lism(records, results: list[dict], by_image: dict, boxes_of: dict, test_dir) -> tuple[list, list, dict]:
    """Every record's `lism_unit` result (records sorted by image id, results in the same order) -> (train rows,
    test items written under `test_dir` (`eval.global_local.test_items`), meta)."""
    from clipfinetune.eval.global_local import test_items

    train_rows, tests, skipped, other_splits = [], [], [], {}
    for record, res in zip(records, results, strict=True):
        image_id, split = record.image_id, _split(record)
        if "split" in res:
            other_splits[split] = other_splits.get(split, 0) + 1
            continue
        if "skip" in res:
            skipped.append({"image_id": image_id, **({"file": res["file"]} if "file" in res else {}),
                            "reason": res["skip"]})
            continue
        texts = by_image[image_id]["text"].tolist()
        idx = by_image[image_id]["sentence_index"].tolist()
        boxes = boxes_of.get(image_id, [])
        matches = [SentenceMatch(i, c, score) for i, c, score in res["matches"]]
        if split == TEST_SPLIT:
            best = choose_test_pair(matches)
            crop = (best.candidate, boxes[best.candidate - 1]) if best.candidate else None
            tests.append(test_items(record.read_image(), image_id, record.image, record.long_caption,
                                    texts[best.sentence_index], crop, best.score, test_dir))
            continue
        full = (0.0, 0.0, float(res["size"][0]), float(res["size"][1]))
        chosen = choose_training_pair(matches)
        for m in matches:
            box = boxes[m.candidate - 1] if m.candidate else full
            train_rows.append({"image_id": image_id, "sentence_index": idx[m.sentence_index],
                               "sentence": texts[m.sentence_index].strip(), "x0": box[0], "y0": box[1],
                               "x1": box[2], "y1": box[3], "score": m.score, "chosen": m is chosen,
                               "kind": "region" if m.candidate else "global"})
    n_train = sum(1 for r in records if _split(r) == TRAIN_SPLIT)
    split_of = {r.image_id: _split(r) for r in records}
    train_skipped = sum(1 for s in skipped if split_of[s["image_id"]] == TRAIN_SPLIT)
    n_pairs = sum(1 for r in train_rows if r["chosen"])
    meta = {"n_train_images": n_train, "n_test_images": len(tests), "n_pairs": n_pairs,
            "global_wins": n_train - train_skipped - n_pairs, "skipped": skipped, "other_splits": other_splits}
    return train_rows, tests, meta


def read_ground_truth(path, sentences) -> dict:
    """The sample world's LISM truth (jsonl: example_id, sentence or sentence_index, box) -> {(image_id, sentence
    text): box}; sentences are matched by text, so the sentence splitter may differ."""
    import json

    by_image = {k: g for k, g in sentences.groupby("image_id")}
    truth = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            image_id = str(rec["example_id"])
            text = rec.get("sentence")
            if text is None and image_id in by_image:
                g = by_image[image_id]
                hit = g[g["sentence_index"] == rec["sentence_index"]]
                text = hit["text"].iloc[0] if len(hit) else None
            if text is not None:
                truth[(image_id, text.strip())] = tuple(rec["box"])
    return truth
