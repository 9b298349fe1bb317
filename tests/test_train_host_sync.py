"""No host sync in the training step: over short `Trainer.fit` runs of every method on the CPU, every read of tensor
data by the host (`.item()`, `bool()` / `int()` / `float()` of a tensor, `.tolist()`, `nonzero`, a boolean-mask
index, `unique`, ...) comes from a line of `clipfinetune/` that says so in a `# sync:` comment, and the loop's own
fetch of the logged values happens once per `log_every` block, not once per step. On a GPU each such read waits for
every queued kernel; the CPU run finds them by watching the ops (torch's CUDA sync debug mode needs a GPU)."""
from __future__ import annotations

import copy
import linecache
import random
import traceback
from pathlib import Path

import pytest
import torch
from fixtures.methods import FixedNegatives, coco_record, random_image, shard_record, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import default_collate

from clipfinetune.data.loader import ExampleContext
from clipfinetune.methods import get_method
from clipfinetune.train import TrainConfig, Trainer

PACKAGE = Path(__file__).resolve().parents[1] / "clipfinetune"
aten = torch.ops.aten
# ops whose result the host must read from the device: a scalar, or a shape that depends on the data
READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
         aten.masked_select.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
         aten.repeat_interleave.Tensor, aten.equal.default, aten.is_nonzero.default}
# ops that read the data when an index is a boolean mask (x[mask], x[mask] = y)
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
W, H = 120, 90
STEPS, LOG_EVERY = 4, 3                     # fetches at steps 3 (the block) and 4 (the end)


class HostReads(TorchDispatchMode):
    """Every host read of tensor data inside the block, as (the `clipfinetune/` line that caused it, its op); torch's
    internals count toward the line of ours that called them."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        masked = func in MASK_INDEXED and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None)
        if func in READS or masked:
            self.record(str(func))
        return func(*args, **kwargs)

    def record(self, op: str) -> None:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if Path(frame.filename).resolve().is_relative_to(PACKAGE):
                self.reads.append((frame.filename, frame.lineno, op))
                return
        self.reads.append(("<outside clipfinetune>", 0, op))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        mode = self

        def tolist(t):                      # reads the data without an aten op of its own
            mode.record("Tensor.tolist")
            return mode._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def commented(filename: str, lineno: int) -> bool:
    """The line, or the comment line right above it, carries `# sync:`."""
    line, above = linecache.getline(filename, lineno), linecache.getline(filename, lineno - 1)
    return "# sync:" in line or above.strip().startswith("#") and "# sync:" in above


# ------------------------------------------------------------------------------------------ crafted data
CAPTION = "A picture of two shapes. There is a small red circle in the top left corner. The rest is grey."


def docci_record(i: int, paired: bool) -> dict:
    second, third = CAPTION.index("There"), CAPTION.index("The rest")
    sentences = [{"text": CAPTION[:second - 1], "char_span": [0, second - 1]},
                 {"text": CAPTION[second:third - 1], "char_span": [second, third - 1]}]
    if i % 2:
        sentences.append({"text": CAPTION[third:], "char_span": [third, len(CAPTION)]})
    return shard_record(f"train_{i:05d}", "docci", W, H, long_caption=CAPTION, sentences=sentences,
                        local_pair=[{"sentence_index": 1, "box": [10, 5, 50, 40]}] if paired else [])


def coco(i: int) -> dict:
    record = coco_record(i, W, H, box=(10, 20, 60, 70) if i % 3 else (200, 200, 300, 300))   # some off the image
    if i % 2:                                                  # fewer LLM negatives than DeGLA's K = 4
        record["negatives"] = record["negatives"][:1]
    return record


RUNS = {   # method, its arguments, the records (with rows some terms leave out: no pair, few negatives, ...)
    "clip": ("clip", {}, coco),
    "harmoclip": ("harmoclip", {}, coco),
    "fsc_clip": ("fsc_clip", {}, coco),
    "degla": ("degla", {}, coco),
    "goal": ("goal", {}, lambda i: docci_record(i, paired=i % 2 == 0)),
    "mulclip": ("mulclip", {"max_sentences": 4}, lambda i: docci_record(i, paired=True)),
    "custom": ("custom", {"terms": {"fsc_clip.local_hn": 0.5, "degla.distill": 0.005,
                                    "harmoclip.global_region": 1.0}}, coco),
}


def negatives(caption):
    words = caption.split()
    return {"negclip": " ".join(words[::-1]), "replace": None if len(words) % 2 else caption.replace("red", "blue"),
            "shuffle": None}


class Batches:
    def __init__(self, micro):
        self.micro = micro

    def epoch_length(self, epoch):
        return len(self.micro)

    def batches(self, epoch, start=0):
        yield from self.micro[start:]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


def fit_and_watch(tiny, run: str, log_every: int = LOG_EVERY) -> list[tuple[str, int, str]]:
    name, kwargs, record = RUNS[run]
    model = copy.deepcopy(tiny)
    method = FixedNegatives(negatives).on(get_method(name)(**kwargs))
    cfg = TrainConfig(epochs=STEPS // 2, batch_size=4, lr=1e-4, grad_clip=1.0, log_every=log_every)
    ctx = ExampleContext(model.transform, model.tokenize, model.image_size, token_span=model.token_span,
                         tokenize_long=lambda texts: model.tokenize(texts, context_length=248))
    rng = random.Random(0)
    micro = []
    for b in range(2):                                          # two steps an epoch
        records = [record(4 * b + i) for i in range(4)]
        micro.append(default_collate([method.make_example(r, random_image(4 * b + i, W, H), rng, ctx)
                                      for i, r in enumerate(records)]))
    trainer = Trainer(method, model, Batches(micro), cfg)
    with HostReads() as watch:
        trainer.fit()
    assert trainer.step == STEPS
    return watch.reads


@pytest.mark.parametrize("run", list(RUNS))
def test_a_training_run_reads_the_device_only_at_log_steps_and_at_commented_lines(tiny, run):
    reads = fit_and_watch(tiny, run)
    stray = sorted({f"{f}:{n} {op}" for f, n, op in reads if not commented(f, n)})
    assert stray == [], f"{run}: host reads in the step without a `# sync:` comment:\n" + "\n".join(stray)
    loop = [r for r in reads if r[0].endswith("train/loop.py")]
    assert len(loop) == 2, f"{run}: the loop read the device {len(loop)} times in {STEPS} steps (log_every " \
                           f"{LOG_EVERY}: 2 fetches)"


def test_the_loops_fetches_follow_log_every_not_the_step_count(tiny):
    fetches = {k: sum(1 for f, _, _ in fit_and_watch(tiny, "clip", k) if f.endswith("train/loop.py")) for k in (1, 4)}
    assert fetches == {1: STEPS, 4: 1}
