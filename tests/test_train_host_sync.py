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
from clipfinetune.registry import METHODS, MIX
from clipfinetune.sample.pretrain.label_warmup import LabelWarmup, label_warmup
from clipfinetune.sample.pretrain.method import PretrainMethod
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


# Every method of the registry (and the mix) trains on crafted COCO rows, with rows some terms leave out (no pair,
# few negatives, ...), unless it reads DOCCI's long captions; the arguments that make every term of a method run
RECORDS = {"goal": lambda i: docci_record(i, paired=i % 2 == 0), "mulclip": lambda i: docci_record(i, paired=True)}
ARGUMENTS = {"mulclip": {"max_sentences": 4},
             MIX: {"terms": {"fsc_clip.local_hn": 0.5, "degla.distill": 0.005, "harmoclip.global_region": 1.0}}}
RUNS = {m: (m, ARGUMENTS.get(m, {}), RECORDS.get(m, coco)) for m in (*METHODS, MIX)}


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
    ctx = ExampleContext.of_model(model)
    rng = random.Random(0)
    micro = []
    for b in range(2):                                          # two steps an epoch
        records = [record(4 * b + i) for i in range(4)]
        micro.append(default_collate([method.make_example(r, random_image(4 * b + i, W, H), rng, ctx)
                                      for i, r in enumerate(records)]))
    return watch_fit(method, model, micro, log_every)


def watch_fit(method, model, micro: list[dict], log_every: int = LOG_EVERY, lr: float = 1e-4):
    """The host reads of `Trainer.fit` over `micro` (two steps an epoch, STEPS steps)."""
    cfg = TrainConfig(epochs=STEPS // len(micro), batch_size=4, lr=lr, grad_clip=1.0, log_every=log_every)
    trainer = Trainer(method, model, Batches(micro), cfg)
    with HostReads() as watch:
        trainer.fit()
    assert trainer.step == STEPS
    return watch.reads


def assert_synced_only_where_marked(run: str, reads) -> None:
    stray = sorted({f"{f}:{n} {op}" for f, n, op in reads if not commented(f, n)})
    assert stray == [], f"{run}: host reads in the step without a `# sync:` comment:\n" + "\n".join(stray)
    loop = [r for r in reads if r[0].endswith("train/loop.py")]
    assert len(loop) == 2, f"{run}: the loop read the device {len(loop)} times in {STEPS} steps (log_every " \
                           f"{LOG_EVERY}: 2 fetches)"


# ------------------------------------------------------------------------------- the pretraining objectives
def caption_pair_batches(model, regions: bool) -> list[dict]:
    """Two batches as `sample/pretrain/sources.py` serves them: images, one caption each and, with `regions`, every
    object of the batch ([batch row, xyxy] in input pixels, its name's tokens, its class), names repeated."""
    g = torch.Generator().manual_seed(0)
    height, width = model.vision.image_size
    names = ["red circle", "blue square", "green star"]
    out = []
    for b in range(2):
        batch = {"image": torch.randn(4, 3, height, width, generator=g),
                 "text": model.tokenize([f"a {names[(b + i) % 3]} on grey" for i in range(4)])}
        if regions:
            rows = [(i, k) for i in range(4) for k in range(1 + (i + b) % 2)]
            batch["region_boxes"] = torch.tensor([[float(i), 4.0 + 20 * k, 4.0, 30.0 + 20 * k, 40.0] for i, k in rows])
            batch["region_class"] = torch.tensor([(i + k) % 3 for i, k in rows])
            batch["region_text"] = model.tokenize([names[c] for c in batch["region_class"].tolist()])
        out.append(batch)
    return out


def label_batches(model) -> tuple[LabelWarmup, list[dict]]:
    """Two batches of the label warm-up (`sample/pretrain/label_warmup.py`'s own batches), with regions."""
    g = torch.Generator().manual_seed(0)
    (height, width), n = model.vision.image_size, 8
    images, labels = torch.randn(n, 3, height, width, generator=g), (torch.rand(n, 3, generator=g) > 0.5).float()
    boxes = torch.tensor([[4.0, 4.0, 30.0, 40.0], [34.0, 4.0, 60.0, 40.0]])
    regions = [(boxes.clone(), torch.eye(3)[[i % 3, (i + 1) % 3]]) for i in range(n)]
    method, batches = label_warmup(images, labels, embed_dim=model.embed_dim, steps=2, batch_size=4, lr=1e-3,
                                   regions=regions)
    return method, list(batches.batches(0))


@pytest.mark.parametrize("run", list(RUNS))
def test_a_training_run_reads_the_device_only_at_log_steps_and_at_commented_lines(tiny, run):
    assert_synced_only_where_marked(run, fit_and_watch(tiny, run))


@pytest.mark.parametrize("regions", [False, True], ids=["captions", "region_text"])
def test_pretraining_reads_the_device_only_at_log_steps_and_at_commented_lines(tiny, regions):
    """Stage `pretrain`'s objective (the same Trainer): caption pairs, and with the region-text term."""
    model = copy.deepcopy(tiny)
    method = PretrainMethod(region_text_weight=1.0 if regions else 0.0)
    assert_synced_only_where_marked("pretrain", watch_fit(method, model, caption_pair_batches(model, regions)))


def test_the_label_warmup_reads_the_device_only_at_log_steps_and_at_commented_lines(tiny):
    model = copy.deepcopy(tiny)
    method, micro = label_batches(model)
    assert_synced_only_where_marked("label_warmup", watch_fit(method, model, micro, lr=1e-3))


def test_every_pretraining_objective_is_watched():
    """The pretraining objectives are the `Method` subclasses of clipfinetune/sample/pretrain/: a new one fails here
    until it has a test above (a method added to the registry is in RUNS already)."""
    import importlib
    import inspect
    import pkgutil

    from clipfinetune.methods.base import Method
    from clipfinetune.sample import pretrain

    modules = [importlib.import_module(f"{pretrain.__name__}.{m.name}")
               for m in pkgutil.iter_modules(pretrain.__path__)]
    objectives = {c for m in modules for _, c in inspect.getmembers(m, inspect.isclass)
                  if issubclass(c, Method) and c.__module__ == m.__name__}
    assert objectives == {PretrainMethod, LabelWarmup}


def test_the_loops_fetches_follow_log_every_not_the_step_count(tiny):
    fetches = {k: sum(1 for f, _, _ in fit_and_watch(tiny, "clip", k) if f.endswith("train/loop.py")) for k in (1, 4)}
    assert fetches == {1: STEPS, 4: 1}
