"""Figure 3: data stages.

- word_regions at COCO 2017 scale: a synthetic COCO-format caption set (118,287 images, 591,753 captions, 80
  COCO category names, ~7.3 instances per image, captions naming annotated objects in singular/plural/multi-word
  forms the way COCO captions do) generated once into benchmarks/_work/coco_synth/. Timed: the stage's work
  (read both JSON files, `build_word_regions` with its default process count, write the parquet). Goal < 30 s.
- sentences: `split_sentences` over synthetic DOCCI-length long captions (~130 words, 6-9 sentences, some line
  breaks and abbreviations); captions/s after loading spaCy (information).
- shard writing: `write_shards` of a few hundred real samples (images extracted from data/shards) into
  benchmarks/_work; MB/s of tar written (information; includes the image check each sample gets).
- loader: `ShardLoader` (plain CLIP, batch 64, 2 workers) over one epoch of the real shards, samples/s from the
  first batch to the last, vs the trainer's consumption: samples/s of `Trainer.train_step` alone on a fixed batch
  of the same size (the loader has to keep up with that). Goal: loader >= consumption.
"""
from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

from .common import SHARDS, WORK, Row, median

COCO_CATEGORIES = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light",
    "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow",
    "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee",
    "skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard",
    "tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple",
    "sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone",
    "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors", "teddy bear",
    "hair drier", "toothbrush"]
N_IMAGES, N_CAPTIONS = 118_287, 591_753
SUBJECTS = ["man", "woman", "person", "group of people", "young boy", "little girl", "couple", "child", "player"]
VERBS = ["sitting on", "standing next to", "holding", "looking at", "riding", "walking past", "near", "on top of",
         "in front of", "beside", "playing with", "carrying"]
PLACES = ["in a kitchen", "on a city street", "in a park", "on the beach", "in a living room", "at the table",
          "in the snow", "next to a building", "on a grassy field", "in a parking lot", ""]
ADJS = ["large", "small", "red", "white", "black", "wooden", "old", "brown", "green", "blue", "yellow", "big"]
NUMS = {2: "two", 3: "three", 4: "four", 5: "several"}


def plural(name: str) -> str:
    last = name.split()[-1]
    irregular = {"person": "people", "mouse": "mice", "knife": "knives", "sheep": "sheep", "skis": "skis",
                 "bus": "buses", "couch": "couches", "sandwich": "sandwiches", "glass": "glasses",
                 "scissors": "scissors", "broccoli": "broccoli", "tv": "tvs"}
    p = irregular.get(last) or (last[:-1] + "ies" if last.endswith("y") and last[-2] not in "aeiou" else last + "s")
    return " ".join(name.split()[:-1] + [p])


def synth_coco(out: Path, seed: int = 0) -> tuple[Path, Path]:
    """COCO-format instances + captions JSON at COCO 2017 train scale (cached)."""
    inst_p, cap_p = out / "instances_train.json", out / "captions_train.json"
    if inst_p.is_file() and cap_p.is_file():
        return inst_p, cap_p
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cats = [{"id": i + 1, "name": n, "supercategory": "thing"} for i, n in enumerate(COCO_CATEGORIES)]
    weights = [40 if n == "person" else 1 + 8 / (1 + i % 20) for i, n in enumerate(COCO_CATEGORIES)]
    images, anns, caps = [], [], []
    extra = N_CAPTIONS - 5 * N_IMAGES
    for i in range(1, N_IMAGES + 1):
        w, h = rng.choice([(640, 480), (640, 427), (480, 640), (500, 375), (640, 426)])
        images.append({"id": i, "width": w, "height": h, "file_name": f"{i:012d}.jpg"})
        n_obj = min(20, max(1, int(rng.expovariate(1 / 7.3)) + 1))
        present = rng.choices(range(80), weights=weights, k=n_obj)
        for c in present:
            bw, bh = rng.uniform(5, w * 0.8), rng.uniform(5, h * 0.8)
            x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": c + 1, "iscrowd": int(rng.random() < 0.01),
                         "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)], "area": bw * bh})
        counts = Counter(present)
        for _ in range(5 + (1 if i <= extra else 0)):
            caps.append({"id": len(caps) + 1, "image_id": i, "caption": caption(rng, counts)})
    (inst_p.parent / "tmp.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    (inst_p.parent / "tmp.json").rename(inst_p)
    (cap_p.parent / "tmp.json").write_text(json.dumps({"images": images, "annotations": caps}))
    (cap_p.parent / "tmp.json").rename(cap_p)
    return inst_p, cap_p


def caption(rng: random.Random, counts: Counter) -> str:
    def phrase(c):
        name, n = COCO_CATEGORIES[c], counts[c]
        if n > 1 and rng.random() < 0.6:
            return f"{NUMS.get(n, 'many')} {plural(name)}"
        return f"{'an' if name[0] in 'aeiou' else 'a'} {rng.choice(ADJS) + ' ' if rng.random() < 0.4 else ''}{name}"

    objs = list(counts)
    rng.shuffle(objs)
    subj = phrase(objs[0]) if rng.random() < 0.7 else "a " + rng.choice(SUBJECTS)
    obj = (phrase(objs[1]) if len(objs) > 1 and rng.random() < 0.7
           else f"the {rng.choice(['table', 'road', 'wall', 'grass', 'sky', 'water'])}")
    text = f"{subj} {rng.choice(VERBS)} {obj} {rng.choice(PLACES)}".strip()
    if rng.random() < 0.1:
        text = text.replace(" ", "  ", 1)
    text = text[0].upper() + text[1:] + ("." if rng.random() < 0.7 else "")
    return text


# ------------------------------------------------------------------------------------------ word_regions
def word_regions_bench(log=print) -> Row:
    from clipfinetune.data.prepare.word_regions import build_word_regions
    from clipfinetune.data.readers.coco import load_json
    from clipfinetune.io import write_parquet

    t0 = time.perf_counter()
    inst_p, cap_p = synth_coco(WORK / "coco_synth")
    log(f"  fig3 word_regions: synthetic COCO ready ({time.perf_counter() - t0:.1f} s, not timed)")
    import resource

    def cpu():
        return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
                   for f in ("ru_utime", "ru_stime"))

    cpu0 = cpu()
    t0 = time.perf_counter()
    instances, captions = load_json(inst_p), load_json(cap_p)      # as the stage reads them
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    frame, meta = build_word_regions(instances, captions, instances_path=inst_p, captions_path=cap_p)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_parquet(WORK / "coco_synth" / "word_regions.parquet", frame)
    t_write = time.perf_counter() - t0
    wall = t_load + t_build + t_write
    cpu_s = cpu() - cpu0                 # this process + the pool's worker processes (joined)
    n = meta["captions"]
    log(f"  fig3 word_regions: {n} captions, load {t_load:.1f} s + build {t_build:.1f} s + write {t_write:.1f} s "
        f"(CPU {cpu_s:.1f} s over all processes)")
    return Row("3 word_regions, COCO scale (wall s)", wall, 30.0, wall / 30.0, "< 30 s", wall < 30.0, "s",
               {"captions": n, "images": len(instances["images"]), "annotations": len(instances["annotations"]),
                "captions_per_s": n / wall, "captions_per_s_build_only": n / t_build, "load_json_s": t_load,
                "build_s": t_build, "write_parquet_s": t_write, "cpu_s_all_processes": cpu_s, "rows": meta["rows"],
                "captions_matched": meta["captions_matched"]},
               [("in process: benchmarks.fig3_data.synth_coco(benchmarks/_work/coco_synth) (untimed), then "
                "clipfinetune.data.readers.coco.load_json x2 + "
                "clipfinetune.data.prepare.word_regions.build_word_regions(...) "
                "(lemmatizer=lookup, instance_rule=largest, default processes) + io.write_parquet")])


# ------------------------------------------------------------------------------------------ sentences
LONG_SENTENCES = [
    "A {adj} {noun} sits on a {adj2} table near the window.",
    "The {noun} is about 3.5 m from the camera, e.g. slightly to the left.",
    "Behind it, a {adj} wall is painted {color} and has a small crack running down its middle.",
    "To the right there is a {noun2} with {color} stripes, partially hidden by shadow.",
    "Dr. Smith's sign hangs above the door, reading \"Open 9 a.m. to 5 p.m.\"",
    "The lighting is soft and warm, casting long shadows across the {adj2} floor",
    "In the background, {num} {noun2}s are lined up along the fence.",
    "The sky is overcast; a few {color} birds fly over the trees.",
    "A {noun} made of {adj} plastic lies upside down on the ground.",
]


def synth_long_captions(n: int, seed: int = 0) -> list:
    from clipfinetune.data.readers import Record

    rng = random.Random(seed)
    nouns = ["cup", "dog", "bicycle", "lamp", "vase", "chair", "book", "bottle", "cat", "clock"]
    adjs = ["red", "small", "wooden", "shiny", "old", "large", "round", "white"]
    recs = []
    for i in range(n):
        k = rng.randint(8, 12)
        sents = [rng.choice(LONG_SENTENCES).format(adj=rng.choice(adjs), adj2=rng.choice(adjs), noun=rng.choice(nouns),
                                                    noun2=rng.choice(nouns), color=rng.choice(adjs),
                                                    num=rng.choice(["two", "three", "four"])) for _ in range(k)]
        text = " ".join(sents)
        if rng.random() < 0.2:
            text = text.replace(". ", ".\n", 1)
        recs.append(Record(source="docci", image_id=f"train_{i:05d}", image=f"train_{i:05d}.jpg", long_caption=text))
    return recs


def sentences_bench(n: int = 600, log=print) -> Row:
    from clipfinetune.data.prepare.sentences import split_sentences

    split_sentences(synth_long_captions(4, seed=99))            # load spaCy (not timed)
    recs = synth_long_captions(n)
    words = sum(len(r.long_caption.split()) for r in recs) / n
    t0 = time.perf_counter()
    _frame, meta = split_sentences(recs)
    dt = time.perf_counter() - t0
    log(f"  fig3 sentences: {n} long captions ({words:.0f} words avg) in {dt:.2f} s")
    return Row("3 sentences stage (long captions/s)", n / dt, None, None, "info", None, "captions/s",
               {"captions": n, "mean_words": words, "seconds": dt, "sentences": meta["rows"],
                "docci_15k_estimate_s": 15000 / (n / dt)},
               [("in process: clipfinetune.data.prepare.sentences.split_sentences("
                 f"benchmarks.fig3_data.synth_long_captions({n}))"
                " after one warm-up call (spaCy load untimed)")])


# ------------------------------------------------------------------------------------------ shard writing
def shard_write_bench(n: int = 400, log=print) -> Row:
    import shutil

    from clipfinetune.data.prepare.shards import write_shards
    from clipfinetune.data.readers import Record

    from .fig2_methods import shard_samples

    src = WORK / "shard_src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    records = []
    for key, jpg, rec in shard_samples()[:n]:
        p = src / f"{key}.jpg"
        p.write_bytes(jpg)
        meta = {k: v for k, v in rec.items() if k not in ("width", "height")}
        record = Record(source=rec["source"], image_id=rec["image_id"], image=str(p))
        records.append({"key": key, "record": record, "size": (rec["width"], rec["height"]),
                        "txt": (rec["captions"] or [rec.get("long_caption", "")])[0], "json": meta})
    out = WORK / "shard_out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    t0 = time.perf_counter()
    write_shards(records, out, maxcount=100, val_fraction=0.05, counts=Counter())
    dt = time.perf_counter() - t0
    mb = sum(p.stat().st_size for p in out.glob("*.tar")) / 1e6
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)
    log(f"  fig3 shards: {n} samples, {mb:.1f} MB in {dt:.2f} s")
    return Row("3 shard writing (MB/s)", mb / dt, None, None, "info", None, "MB/s",
               {"samples": n, "mb": mb, "seconds": dt, "samples_per_s": n / dt},
               [(f"in process: clipfinetune.data.prepare.shards.write_shards(<{n} samples of data/shards, "
                "images extracted to "
                "benchmarks/_work/shard_src>, benchmarks/_work/shard_out, maxcount=100, val_fraction=0.05)")])


# ------------------------------------------------------------------------------------------ loader vs consumption
def loader_bench(model_dir, batch_size: int = 64, workers: int = 2, log=print) -> Row:
    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model
    from clipfinetune.train import TrainConfig, Trainer

    from .fig2_methods import FixedSource, make_batch, shard_samples

    model = load_model("local-dir:" + str(model_dir))
    method = build_method("clip")
    ctx = ExampleContext.of_model(model)
    rates = []
    for epoch in range(2):                      # fresh loader each time: worker start-up not counted
        t0 = time.perf_counter()
        loader = ShardLoader(SHARDS, "train", method, ctx, batch_size=batch_size, seed=0, num_workers=workers)
        t_init = time.perf_counter() - t0
        it = loader.batches(epoch)
        next(it)
        t0, n = time.perf_counter(), 0
        for b in it:
            n += b["image"].shape[0]
        rates.append(n / (time.perf_counter() - t0))
        del it, loader
    loader_sps = median(rates)
    # consumption: the trainer's step alone on a fixed batch of the same size
    batch = make_batch(method, ctx, shard_samples(), batch_size)
    cfg = TrainConfig(epochs=1, batch_size=batch_size, lr=2e-4, wd=0.1, grad_clip=1.0)
    trainer = Trainer(method, model, FixedSource(batch), cfg)
    trainer.module.train()
    for _ in range(2):
        trainer.train_step([batch])
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        trainer.train_step([batch])
        times.append(time.perf_counter() - t0)
    consume = batch_size / median(times)
    log(f"  fig3 loader: {loader_sps:.0f} samples/s (2 workers) vs trainer consumption {consume:.0f} samples/s")
    return Row("3 loader vs trainer consumption (samples/s)", loader_sps, consume, loader_sps / consume, ">= 1.0x",
               loader_sps >= consume, "samples/s",
               {"batch_size": batch_size, "workers": workers, "loader_epoch_rates": rates, "loader_init_s": t_init,
                "trainer_step_ms": [t * 1e3 for t in times]},
               [("in process: ShardLoader(data/shards, 'train', clip, batch_size=64, num_workers=2).batches(epoch) "
                "timed from the first batch to the end of the epoch (2 epochs, fresh loader each); "
                "Trainer.train_step on a fixed batch of 64 (8 timed steps after 2 warm-up)")])


def figure(model_dir, log=print) -> list[Row]:
    return [word_regions_bench(log=log), sentences_bench(log=log), shard_write_bench(log=log),
            loader_bench(model_dir, log=log)]
