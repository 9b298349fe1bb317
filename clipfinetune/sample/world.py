"""Generate the whole embedded sample world into a directory (the layout of DEVELOPERS.md).

Every image is drawn from its own random stream `default_rng([seed, stream, index])`, so the world is a
deterministic function of the seed (byte-identical files), and changing one count (say n_train) leaves
every other corpus untouched. The caller makes the write atomic (stages/sample.py renders into a
temporary directory and renames it).

Besides the benchmark files, `scenes.jsonl` records the ground truth of every generated image (path,
objects with shape, colour, size, drawn RGB, centre and xyxy box), from which everything else derives.

The `pretrain` split exists only to train the from-scratch base CLIP (stage `pretrain`, which stands in for a
web-pretrained model, so its corpus may differ from the fine-tuning corpora): few objects per image (1 to
PRETRAIN_OBJECTS) and captions that vary in what they name (`captions.pretraining_captions`: shapes only, every
object with its colour, or an ordinary short caption). Each image's `images[]` entry carries the colour of its
first object (`colour`), the group `pretrain` batches by (`sample.pretrain.sources.CaptionPairSource`), and, for a
one-object image, its shape and colour (`labels`, else empty), the targets of the image tower's label warm-up
(`sample.pretrain.label_warmup`: on one-object images the tiny ViT learnt shape about twice as fast as on all images'
sets of shapes and colours, 45% vs 24% after 200 steps), and every object's box, labels and name ("a red circle")
(`regions`), the targets of the warm-up's region term and of pretraining's region-text term. A share of the images are
close-ups of one large object (CLOSEUP_SHARE). On the short captions of the 2-4-object train scenes a tiny CLIP learns
colour and stays shape-blind (issue 22).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import aro, compositional, formats
from .captions import long_description, noun_phrase, pretraining_captions, short_captions
from .render import jpeg_bytes, render
from .scene import Scene, make_obj, new_scene, place, random_background, random_specs
from .vocab import COLOUR_NAMES, SHAPE_NAMES, SIZES, ZEROSHOT_TEMPLATES

STREAMS = {"train": 1, "val": 2, "docci_train": 3, "docci_test": 4, "aro_relation": 5, "aro_attribution": 6,
           "zs_shape": 7, "zs_shape_color": 8, "aro_pairs": 9, "sugarcrepe": 10, "pretrain": 11}
VAL_ID_OFFSET = 1_000_000       # COCO ids: train 1..n_train, val 1_000_001.., pretrain 2_000_001..; disjoint
PRETRAIN_ID_OFFSET = 2_000_000
PRETRAIN_OBJECTS = 2            # objects per pretraining image: 1..PRETRAIN_OBJECTS
# Close-ups: this share of the pretraining images holds one object of radius CLOSEUP_RADIUS x the image side (38-54 px
# wide at 64 px). Web photos show objects at every scale; a base that saw only 17-35 px objects encoded the upscaled
# crops GOAL's LISM and crop-based region scoring feed it poorly (8-shape accuracy on crops 43% vs 92% whole, #22).
CLOSEUP_SHARE = 0.2
CLOSEUP_RADIUS = (0.3, 0.42)


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 0
    image_size: int = 64
    n_train: int = 2000
    n_val: int = 300
    n_docci_train: int = 1000
    n_docci_test: int = 200
    n_compositional: int = 400
    n_zeroshot_per_class: int = 20
    n_pretrain: int = 0             # images of the pretraining-only split (0 = none)


def _rng(cfg: WorldConfig, stream: str, index: int = 0) -> np.random.Generator:
    return np.random.default_rng([cfg.seed, STREAMS[stream], index])


class _Writer:
    def __init__(self, root: Path):
        self.root, self.scene_lines = root, []

    def image(self, rel: str, scene: Scene, rng: np.random.Generator, split: str) -> bytes:
        data = jpeg_bytes(render(scene, rng))
        self.bytes(rel, data)
        self.scene_lines.append({"image": rel, "split": split, **scene.record()})
        return data

    def bytes(self, rel: str, data: bytes) -> None:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    def text(self, rel: str, text: str) -> None:
        self.bytes(rel, text.encode("utf-8"))


def _coco_split(w: _Writer, cfg: WorldConfig, split: str, n: int, id0: int):
    pretraining = split == "pretrain"
    lo, hi = (1, PRETRAIN_OBJECTS) if pretraining else (2, 4)
    scenes, caps, ids, names = [], [], [], []
    for i in range(n):
        rng = _rng(cfg, split, i)
        iid = id0 + i
        fn = f"{iid:012d}.jpg"
        if pretraining and rng.random() < CLOSEUP_SHARE:
            objs = [_closeup(rng, cfg.image_size)]
        else:
            specs = random_specs(rng, int(rng.integers(lo, hi + 1)))
            objs = place(rng, specs, cfg.image_size)
            if len(objs) < lo:          # a large object left no room for the rest: all small
                objs = place(rng, [(shape, colour, "small") for shape, colour, _ in specs], cfg.image_size)
        sc = new_scene(fn[:-4], cfg.image_size, random_background(rng), objs)
        caps.append(pretraining_captions(rng, sc, 5) if pretraining else short_captions(rng, sc, 5))
        w.image(f"images/{split}/{fn}", sc, rng, split)
        scenes.append(sc), ids.append(iid), names.append(fn)
    captions = formats.captions(scenes, ids, names, caps)
    if pretraining:       # the batch group of `pretrain` (clipfinetune.sample.pretrain.sources.CaptionPairSource)
        for image, sc in zip(captions["images"], scenes):
            image["colour"] = sc.objects[0].colour
            image["labels"] = [sc.objects[0].shape, sc.objects[0].colour] if len(sc.objects) == 1 else []
            image["regions"] = [{"box": o.bbox, "labels": [o.shape, o.colour],
                                 "text": noun_phrase(o.shape, 1, o.colour)}
                                for o in sc.objects]
    else:
        w.text(f"annotations/instances_{split}.json", formats.dumps(formats.instances(scenes, ids, names)))
    w.text(f"annotations/captions_{split}.json", formats.dumps(captions))
    return scenes, ids, names, caps


def _closeup(rng: np.random.Generator, size: int):
    """One large object, wholly inside the image (captions call it "large"); a draw that sticks out is redrawn."""
    (shape, colour, _), = random_specs(rng, 1)
    while True:
        r = float(rng.uniform(*CLOSEUP_RADIUS)) * size
        cx, cy = rng.uniform(r + 1, size - r - 1, 2)
        o = make_obj(rng, shape, colour, "large", float(cx), float(cy), r)
        if min(o.bbox[:2]) >= 0.5 and max(o.bbox[2:]) <= size - 0.5:
            return o


def _docci_objects(rng) -> int:
    u = rng.random()
    if u < 0.7:
        return int(rng.integers(3, 9))
    return int(rng.integers(9, 13)) if u < 0.9 else int(rng.integers(13, 17))


def _docci(w: _Writer, cfg: WorldConfig, split: str, n: int):
    lines, gt = [], []
    for i in range(n):
        rng = _rng(cfg, f"docci_{split}", i)
        eid = f"{split}_{i:05d}"
        k = _docci_objects(rng)
        specs = random_specs(rng, k, p_large=0.3 if k <= 5 else 0.0, unique=True)
        objs = place(rng, specs, cfg.image_size, grid=k > 8)
        sc = new_scene(eid, cfg.image_size, random_background(rng), objs)
        extra = int(rng.integers(2, 4)) if len(objs) >= 13 else int(rng.integers(0, 3))
        text, order = long_description(rng, sc, extra)
        data = w.image(f"images/docci/{eid}.jpg", sc, rng, f"docci_{split}")
        w.bytes(f"docci/images/{eid}.jpg", data)
        lines.append({"example_id": eid, "split": split, "image_file": f"{eid}.jpg", "description": text})
        for s, j in enumerate(order, start=1):
            gt.append({"example_id": eid, "sentence_index": s, "box": objs[j].bbox, "category": objs[j].shape})
    return lines, gt


def _aro(w: _Writer, cfg: WorldConfig) -> dict[str, list[dict]]:
    n = cfg.n_compositional
    rel_cases = []
    for i in range(n):
        rel = aro.ARO_RELATIONS[i % len(aro.ARO_RELATIONS)]
        rng = _rng(cfg, "aro_relation", i)
        sc, rec = aro.relation_case(rng, f"aro_rel_{i:06d}", cfg.image_size, rel)
        w.image(f"aro/images/{sc.image_id}.jpg", sc, rng, "aro_relation")
        rel_cases.append({"image_path": f"{sc.image_id}.jpg", "image_id": sc.image_id, **rec})
    pairs = aro.attribute_pairs(_rng(cfg, "aro_pairs"), n)
    att_cases = []
    for i in range(n):
        rng = _rng(cfg, "aro_attribution", i)
        sc, rec = aro.attribution_case(rng, f"aro_att_{i:06d}", cfg.image_size, pairs[i % len(pairs)])
        w.image(f"aro/images/{sc.image_id}.jpg", sc, rng, "aro_attribution")
        att_cases.append({"image_path": f"{sc.image_id}.jpg", "image_id": sc.image_id, **rec})
    return {"visual_genome_relation": rel_cases, "visual_genome_attribution": att_cases}


def _zeroshot(w: _Writer, cfg: WorldConfig, task: str) -> int:
    classes = ([(s, None) for s in SHAPE_NAMES] if task == "shape"
               else [(s, c) for s in SHAPE_NAMES for c in COLOUR_NAMES])
    folders = sorted((f"{c}_{s}" if c else s, s, c) for s, c in classes)
    count = 0
    for ci, (folder, shape, colour) in enumerate(folders):
        for i in range(cfg.n_zeroshot_per_class):
            rng = _rng(cfg, f"zs_{task}", ci * 100_000 + i)
            col = colour or COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
            size = list(SIZES)[int(rng.integers(2))]
            objs = place(rng, [(shape, col, size)], cfg.image_size)
            sc = new_scene(f"{folder}_{i:04d}", cfg.image_size, random_background(rng), objs)
            w.image(f"zeroshot/{task}/test/{folder}/{sc.image_id}.jpg", sc, rng, f"zeroshot_{task}")
            count += 1
    w.text(f"zeroshot/{task}/classnames.txt", "".join(f.replace("_", " ") + "\n" for f, _, _ in folders))
    w.text(f"zeroshot/{task}/templates.txt", "".join(t + "\n" for t in ZEROSHOT_TEMPLATES))
    return count


def generate_world(out_dir: str | Path, cfg: WorldConfig) -> dict:
    """Write the sample world under `out_dir` (which must be empty or absent); returns meta.json's dict."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    w = _Writer(root)
    train = _coco_split(w, cfg, "train", cfg.n_train, 1)
    val_scenes, val_ids, val_names, val_caps = _coco_split(w, cfg, "val", cfg.n_val, VAL_ID_OFFSET + 1)
    pre = _coco_split(w, cfg, "pretrain", cfg.n_pretrain, PRETRAIN_ID_OFFSET + 1)

    w.text("karpathy/dataset_coco.json", formats.dumps(formats.karpathy(
        [("train", "train", train[1], train[2], train[3]), ("test", "val", val_ids, val_names, val_caps)])))
    w.text("karpathy/coco_karpathy_test.json", formats.dumps(formats.karpathy_test_blip("val", val_names, val_caps)))

    docci_lines, docci_gt = [], []
    for split, n in (("train", cfg.n_docci_train), ("test", cfg.n_docci_test)):
        lines, gt = _docci(w, cfg, split, n)
        docci_lines += lines
        docci_gt += gt
    w.text("docci/descriptions.jsonlines", formats.jsonlines(docci_lines))
    w.text("docci/lism_ground_truth.jsonl", formats.jsonlines(docci_gt))

    sugar = {}
    for k, kind in enumerate(compositional.KINDS):
        rng = np.random.default_rng([cfg.seed, STREAMS["sugarcrepe"], k])
        sugar[kind] = compositional.sugarcrepe(rng, val_scenes, val_names, kind, cfg.n_compositional)
        w.text(f"sugarcrepe/{kind}.json", formats.dumps(sugar[kind]))
    aro_files = _aro(w, cfg)
    for name, cases in aro_files.items():
        w.text(f"aro/{name}.json", formats.dumps(cases))

    w.text("box_cls/instances_shape.json", formats.dumps(formats.instances(val_scenes, val_ids, val_names)))
    w.text("box_cls/instances_shape_color.json",
           formats.dumps(formats.instances(val_scenes, val_ids, val_names, colour_labels=True)))
    zs = {task: _zeroshot(w, cfg, task) for task in ("shape", "shape_color")}

    w.text("scenes.jsonl", formats.jsonlines(w.scene_lines))
    meta = {
        "generator": "clipfinetune.sample", "config": asdict(cfg), "seed": cfg.seed,
        "counts": {
            "train_images": cfg.n_train, "val_images": cfg.n_val,
            "train_objects": sum(len(s.objects) for s in train[0]),
            "val_objects": sum(len(s.objects) for s in val_scenes),
            "train_captions": sum(len(c) for c in train[3]), "val_captions": sum(len(c) for c in val_caps),
            "pretrain_images": cfg.n_pretrain, "pretrain_objects": sum(len(s.objects) for s in pre[0]),
            "docci_train": cfg.n_docci_train, "docci_test": cfg.n_docci_test,
            "docci_object_sentences": len(docci_gt),
            "sugarcrepe": {k: len(v) for k, v in sugar.items()},
            "aro": {k: len(v) for k, v in aro_files.items()},
            "zeroshot_images": zs, "scenes": len(w.scene_lines),
        },
        "shapes": SHAPE_NAMES, "colours": COLOUR_NAMES,
    }
    w.text("meta.json", formats.dumps(meta))
    return meta
