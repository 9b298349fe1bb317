"""GOAL's LISM step 2: match each sentence of a long caption to an image region (docs/methods.md §3.1).

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

On a GPU (`Matcher` with the model on CUDA) the candidates and sentences of all the images of a work unit
are encoded together, `batch_size` per forward, so the crops of many images share a forward. A GPU run
guarantees the same matching rule and the same outputs' schema and ordering; its scores are the GPU's fp32
float bits, which depend on the kernels cuBLAS/cuDNN pick for each batch shape, so they can differ from the CPU's
(and between GPU models or library versions) in low bits, and an argmax between near-ties may flip. A re-run on
the same GPU, software and unit size computes the same batches; it is not promised bit for bit (the parts of an
interrupted run are reused as they are).

The stage's loop is split for ranks and resume (stages/lism.py, clipfinetune/parts.py): `Matcher` matches the
images of each work unit (a JSON-able result per image; images decoded and crops cut in DataLoader workers) and
writes a test image's two items of GOAL's joint test list (`clipfinetune.data.evalsets.global_local`: the original file
linked, the chosen crop as a PNG) inside the unit, beside its part; `assemble_lism` turns every image's result, in image
order, into the stage's rows, test items and counts: the same whichever rank matched an image, so rank 0's tail
only links the units' files into the output.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from clipfinetune.data.evalsets.global_local import write_items


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


def candidate_pixels(image, boxes: list[tuple], transform) -> torch.Tensor:
    """[1 + R, 3, H, W]: the whole image (candidate 0), then the crop of each segment box (with its background, as
    GOAL's `keep_original_background` leaves it), each through the model's transform. The one place crops are cut."""
    crops = [image.crop(tuple(round(v) for v in box)) for box in boxes]
    return torch.stack([transform(im) for im in [image, *crops]])


class _Embedder:
    """Candidate rows forwarded `batch_size` at a time in the order they arrive; `flush()` forwards the rest and
    returns every row's embedding since the last flush: the batches of cutting the concatenation of the rows into
    `batch_size` pieces, however the rows arrived."""

    def __init__(self, model, batch_size: int):
        self.model, self.batch_size, self.device = model, batch_size, model_device(model)
        self.pending: list[torch.Tensor] = []
        self.done: list[torch.Tensor] = []

    def add(self, rows: torch.Tensor) -> None:
        self.pending.append(rows)
        while sum(len(r) for r in self.pending) >= self.batch_size:
            rows = torch.cat(self.pending)
            self._forward(rows[:self.batch_size])
            self.pending = [rows[self.batch_size:]]

    def flush(self) -> torch.Tensor:
        rest = [r for r in self.pending if len(r)]
        if rest:
            self._forward(torch.cat(rest))
        out = torch.cat(self.done) if self.done else torch.empty(0)
        self.pending, self.done = [], []
        return out

    @torch.inference_mode()
    def _forward(self, batch: torch.Tensor) -> None:
        with fixed_threads() if self.device.type == "cpu" else contextlib.nullcontext():
            emb = self.model.encode_image(batch.to(self.device, non_blocking=True), normalize=True)
        self.done.append(emb.float().cpu())


@torch.inference_mode()
def embed_texts(model, texts: list[str], batch_size: int) -> torch.Tensor:
    out, device = [], model_device(model)
    with fixed_threads() if device.type == "cpu" else contextlib.nullcontext():
        for i in range(0, len(texts), batch_size):
            tokens = model.tokenize(texts[i:i + batch_size]).to(device, non_blocking=True)
            out.append(model.encode_text(tokens, normalize=True).float().cpu())
    return torch.cat(out) if out else torch.empty(0)


def match_image(model, image, sentences: list[str], boxes: list[tuple], batch_size: int = 64):
    """Candidates (global + crops with background) and per-sentence matches for one PIL image, in this thread (the
    stage's `Matcher` computes the same for each image of its units, decoding in DataLoader workers)."""
    embedder = _Embedder(model, batch_size)
    embedder.add(candidate_pixels(image, boxes, model.transform))
    return match_sentences(embed_texts(model, sentences, batch_size), embedder.flush())


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


class _Candidates(Dataset):
    """What matching needs of each record of the units, in order, prepared in a DataLoader worker: {"split"} for
    another split, {"skip", "file"?} when it has no sentences or cannot be read, else {"size": [w, h], "pixels":
    `candidate_pixels`} (the image decoded, its crops cut and transformed off the main thread)."""

    def __init__(self, records: list, with_sentences: set, boxes_of: dict, transform):
        self.records, self.with_sentences, self.boxes_of, self.transform = records, with_sentences, boxes_of, transform

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        from clipfinetune.io import InputError

        record = self.records[i]
        split = _split(record)
        if split not in (TRAIN_SPLIT, TEST_SPLIT):
            return {"split": split}
        if record.image_id not in self.with_sentences:
            return {"skip": "no sentences"}
        try:
            image = record.read_image()
        except InputError as e:
            return {"skip": str(e), "file": str(record.path)}
        return {"size": [image.width, image.height],
                "pixels": candidate_pixels(image, self.boxes_of.get(record.image_id, []), self.transform)}


class Matcher:
    """LISM over work units, for `parts.compute_parts(stream=True)`: `matcher(units)` yields, per unit, one JSON-able
    result per record: {"split"} / {"skip", "file"?} (as `_Candidates`), else {"size", "matches": [[sentence
    position, candidate, score], ...]}, and for a test-split image also "test": its two items of GOAL's joint test
    list (`global_local.write_items`), whose files are written under `files_dir` before the result is yielded (so a
    part's files exist). The items depend on the image alone, never on the rank or the unit that computed it.

    Images are decoded and their crops cut in `workers` DataLoader workers, and the test items' files (the original
    linked, the chosen crop decoded again, cut and encoded as a PNG) written by as many worker processes while the
    next images are matched, so the rank's own process only runs the forwards; `workers` 0 does both in this
    thread. On the CPU each image is
    encoded on its own (byte-identical scores, module docstring); on a GPU (`shared_batches`, by default when the
    model is on one) the candidates and sentences of a unit share batches. `texts_of` / `boxes_of`: {image_id: its
    sentences / its segment boxes} (`lism_inputs`)."""

    def __init__(self, model, texts_of: dict, boxes_of: dict, batch_size: int, files_dir, workers: int = 0,
                 shared_batches: bool | None = None):
        self.model, self.texts_of, self.boxes_of, self.batch_size = model, texts_of, boxes_of, batch_size
        self.files_dir, self.workers = files_dir, workers
        self.shared = model_device(model).type != "cpu" if shared_batches is None else shared_batches
        self.counts = {"images": 0, "candidates": 0, "test_items": 0}

    def __call__(self, units: list) -> Iterator[list[dict]]:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        records = [r for unit in units for r in unit]
        loader = DataLoader(_Candidates(records, set(self.texts_of), self.boxes_of, self.model.transform),
                            batch_size=None, num_workers=self.workers,
                            pin_memory=model_device(self.model).type == "cuda")
        prepared = iter(loader)
        # forked as the DataLoader forks its workers (they never touch CUDA), and gone with the rank as they are
        writers = ProcessPoolExecutor(self.workers, multiprocessing.get_context("fork"), initializer=_exit_with_parent,
                                      initargs=(os.getpid(),)) if self.workers else \
            contextlib.nullcontext(_InThisThread())
        with writers as pool:
            for unit in units:
                yield self._unit(unit, prepared, pool)

    def _unit(self, unit: list, prepared: Iterator[dict], writers) -> list[dict]:
        results, matched, writing = [], [], []
        embedder = _Embedder(self.model, self.batch_size)

        def matches_known(record, item, matches: list[SentenceMatch]) -> None:
            if _split(record) == TEST_SPLIT:        # its list items are written while the next images are matched
                writing.append((item, writers.submit(write_items, record, *self._test_pair(record, matches),
                                                     self.files_dir)))
            item["matches"] = [[m.sentence_index, m.candidate, m.score] for m in matches]

        for record in unit:
            item = next(prepared)           # streamed: a unit's decoded images are never all held at once
            pixels = item.pop("pixels", None)
            results.append(item)
            if pixels is None:
                continue
            embedder.add(pixels)
            self.counts["images"] += 1
            self.counts["candidates"] += len(pixels)
            matched.append((record, item, len(pixels)))
            if not self.shared:                 # one image at a time: its own batches
                texts = self.texts_of[record.image_id]
                matches_known(record, item, match_sentences(embed_texts(self.model, texts, self.batch_size),
                                                            embedder.flush()))
        if self.shared and matched:             # the unit's candidates and sentences in shared batches
            candidate_emb = embedder.flush()
            sentence_emb = embed_texts(self.model, [t for r, _, _ in matched for t in self.texts_of[r.image_id]],
                                       self.batch_size)
            ci = si = 0
            for record, item, n in matched:
                k = len(self.texts_of[record.image_id])
                matches_known(record, item, match_sentences(sentence_emb[si:si + k], candidate_emb[ci:ci + n]))
                ci, si = ci + n, si + k
        for item, written in writing:           # the part is written after its files
            item["test"] = list(written.result())
        self.counts["test_items"] += len(writing)
        return results

    def _test_pair(self, record, matches: list[SentenceMatch]) -> tuple:
        """(sentence, candidate, box, score) of GOAL's joint test list for this image: its single best (sentence,
        candidate) pair, the global image included (`choose_test_pair`)."""
        best = choose_test_pair(matches)
        box = self.boxes_of[record.image_id][best.candidate - 1] if best.candidate else None
        return self.texts_of[record.image_id][best.sentence_index], best.candidate, box, best.score


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """In a writer process: end it when the rank that started it is gone (a killed rank leaves no writers behind;
    a pool's idle worker would otherwise wait for work forever), as DataLoader's workers watch theirs."""
    import threading
    import time

    def watch():
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


class _InThisThread:
    """An executor that runs each job when it is submitted (`workers` 0: everything in the rank's own thread)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:  # noqa: BLE001  (raised where the result is read, as a pool's future does)
            future.set_exception(e)
        return future


def lism_inputs(sentences, segments) -> tuple[dict, dict]:
    """({image_id: its sentences in order}, {image_id: its segment boxes}) from sentences/segments.parquet."""
    by_image = {k: g.sort_values("sentence_index") for k, g in sentences.groupby("image_id")}
    boxes_of = {k: [tuple(r) for r in g[["x0", "y0", "x1", "y1"]].itertuples(index=False)]
                for k, g in segments.groupby("image_id")}
    return by_image, boxes_of


def texts_of(by_image: dict) -> dict:
    """{image_id: its sentences' texts in order} (what `Matcher` matches)."""
    return {k: g["text"].tolist() for k, g in by_image.items()}


def assemble_lism(records, results: list[dict], by_image: dict, boxes_of: dict) -> tuple[list, list, dict]:
    """Every record's `Matcher` result (records sorted by image id, results in the same order) -> (train rows, the
    test list's items in image order (their files written by the units), meta)."""
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
        if split == TEST_SPLIT:
            tests.append(tuple(res["test"]))
            continue
        texts = by_image[image_id]["text"].tolist()
        idx = by_image[image_id]["sentence_index"].tolist()
        boxes = boxes_of.get(image_id, [])
        matches = [SentenceMatch(i, c, score) for i, c, score in res["matches"]]
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
