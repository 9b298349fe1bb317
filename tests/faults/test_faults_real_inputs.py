"""Inputs real corpora hold and the sample world never makes (issue 26), fed through the real stages (in-process
`main()` on a copy of the tiny project) and the readers after them (training loader, eval's image reader):
each gives a correct result, or a counted skip / an InputError naming the file and the record.

Images: CMYK JPEG, greyscale PNG, palette PNG with a transparent colour, 16-bit PNG, JPEG with an EXIF
orientation tag, truncated JPEG, an image above PIL's decompression-bomb limit. Text: a 300-word caption for a
77-token model, a 40-sentence DOCCI description, captions with emoji and non-Latin scripts, a COCO file with
`iscrowd` RLE annotations. docs/reliability.md lists the outcome of each."""
from __future__ import annotations

import functools
import io
import json
import random
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from clipfinetune.io import ImageTooLarge, InputError, read_image

from .test_faults_inputs import (
    CAPTIONS,
    INSTANCES,
    PREPARED,
    docci_lines,
    dump,
    load,
    shard_records,
    write_docci,
)

pytestmark = pytest.mark.faults

COCO_IMAGES = "data/sample/images/train"
DOCCI_IMAGES = "data/sample/docci/images"
GOOD = ("cmyk", "grey", "palette", "sixteen_bit", "exif_rotated")
BAD = ("truncated", "bomb")
EXIF_ORIENTATION = 0x0112


@functools.lru_cache(maxsize=1)
def bomb_png() -> bytes:
    """A 1-bit PNG of 10000 x 9000 = 90 M pixels, above PIL's limit (89.5 M): 11 MB in memory, ~10 kB on disk."""
    assert 10000 * 9000 > Image.MAX_IMAGE_PIXELS
    buf = io.BytesIO()
    Image.new("1", (10000, 9000)).save(buf, "PNG")
    return buf.getvalue()


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def pil_decoded(data: bytes) -> np.ndarray:
    """PIL's own decode + RGB conversion, in the stored frame (what a lossy variant must read as)."""
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def variant(kind: str, orig: Image.Image) -> tuple[str, bytes, np.ndarray | None]:
    """(file suffix, encoded bytes, the RGB pixels a correct reader returns; None for the bad ones)."""
    grey = np.asarray(orig.convert("L"))
    if kind == "cmyk":
        data = encode(orig.convert("CMYK"), "JPEG", quality=95, subsampling=0)
        return ".jpg", data, pil_decoded(data)
    if kind == "grey":
        return ".png", encode(orig.convert("L"), "PNG"), np.repeat(grey[..., None], 3, axis=2)
    if kind == "palette":
        pal = orig.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        clear = pal.getpixel((0, 0))                           # the background colour becomes transparent
        expected = np.asarray(pal.convert("RGB")).copy()
        expected[np.asarray(pal) == clear] = 255               # composited onto white
        return ".png", encode(pal, "PNG", transparency=clear), expected
    if kind == "sixteen_bit":
        wide = Image.fromarray(grey.astype(np.uint16) * 257)   # 8-bit v -> 16-bit v * 257: top byte is v again
        assert wide.mode == "I;16"
        return ".png", encode(wide, "PNG"), np.repeat(grey[..., None], 3, axis=2)
    if kind == "exif_rotated":
        exif = Image.Exif()
        exif[EXIF_ORIENTATION] = 6                             # "rotate 90 CW to display": not applied (stored frame)
        data = encode(orig, "JPEG", quality=95, subsampling=0, exif=exif.tobytes())
        return ".jpg", data, pil_decoded(data)
    if kind == "truncated":
        data = encode(orig, "JPEG", quality=95)
        return ".jpg", data[: len(data) // 3], None
    if kind == "bomb":
        return ".png", bomb_png(), None
    raise ValueError(kind)


def plant_images(proj) -> dict:
    """Replace the first COCO train images and DOCCI images by one variant each (renamed in the annotation files).
    Returns {kind: {"coco": (image_id, path), "docci": (example_id, path), "expected": ..., "orig": array}}."""
    planted = {k: {} for k in (*GOOD, *BAD)}
    caps, inst = load(proj, CAPTIONS), load(proj, INSTANCES)
    ids = sorted(i["id"] for i in caps["images"])
    for kind, image_id in zip(planted, ids):
        img = next(i for i in caps["images"] if i["id"] == image_id)
        old = proj / COCO_IMAGES / img["file_name"]
        orig = Image.open(old).convert("RGB")
        suffix, data, expected = variant(kind, orig)
        name = f"{kind}_{image_id}{suffix}"
        (proj / COCO_IMAGES / name).write_bytes(data)
        old.unlink()
        for doc in (caps, inst):
            next(i for i in doc["images"] if i["id"] == image_id)["file_name"] = name
        planted[kind]["coco"] = (image_id, proj / COCO_IMAGES / name, expected, np.asarray(orig))
    dump(proj, CAPTIONS, caps)
    dump(proj, INSTANCES, inst)
    recs = sorted(docci_lines(proj), key=lambda r: r["example_id"])
    # two test images, then train ones: the bad variants land in training (a bomb in the test split would be an
    # evaluation image with the COCO bomb's bytes, which the leakage check rightly refuses)
    planted_order = [r for r in recs if r["split"] != "train"][:2] + [r for r in recs if r["split"] == "train"]
    for kind, rec in zip(planted, planted_order):
        old = proj / DOCCI_IMAGES / rec["image_file"]
        orig = Image.open(old).convert("RGB")
        suffix, data, expected = variant(kind, orig)
        rec["image_file"] = f"{kind}_{rec['example_id']}{suffix}"
        (proj / DOCCI_IMAGES / rec["image_file"]).write_bytes(data)
        old.unlink()
        planted[kind]["docci"] = (rec["example_id"], proj / DOCCI_IMAGES / rec["image_file"], expected,
                                  np.asarray(orig))
    write_docci(proj, recs)
    return planted


def assert_correct_pixels(kind: str, got: np.ndarray, expected: np.ndarray, orig: np.ndarray) -> None:
    assert got.shape == orig.shape and got.dtype == np.uint8, kind
    np.testing.assert_array_equal(got, expected, err_msg=kind)
    if not kind.startswith(("cmyk", "exif_rotated")):
        return
    diff = np.abs(got.astype(int) - orig).mean()        # a re-encoded JPEG: close to the picture it was made of
    assert diff < 12, f"{kind}: mean |difference| {diff:.1f} to the original pixels"
    if kind.startswith("exif_rotated"):   # the stored frame, not the displayed one: boxes on disk stay valid
        displayed = np.asarray(Image.fromarray(orig).transpose(Image.Transpose.ROTATE_270))
        assert diff < np.abs(got.astype(int) - displayed).mean() / 3


class RecordingMethod:
    """A method for the training loader that keeps every decoded image (the loader hands it PIL RGB)."""
    name = "recording"

    def __init__(self):
        self.images = {}

    def wants(self, record):
        return True

    def make_example(self, record, image, rng, ctx):
        self.images[(record["source"], record["image_id"])] = np.asarray(image)
        return {"n": torch.tensor(1)}


def test_real_image_formats_through_every_image_reader(tiny_project, tmp_path, inprocess):
    from clipfinetune.data.loader import ExampleContext, ShardLoader
    from clipfinetune.eval.encode import load_image

    ref_sh = tiny_project.meta("data/shards/meta.json")
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", "models/base", *PREPARED,
                                               "data/prepared/segments.parquet"])
    planted = plant_images(proj)
    bad_docci = {planted[k]["docci"][0]: k for k in BAD}

    # the one reader (clipfinetune.io.read_image): good formats decode to the right pixels, bad ones name file+record
    for kind in GOOD:
        for source in ("coco", "docci"):
            record, path, expected, orig = planted[kind][source]
            assert_correct_pixels(f"{kind} ({source})", np.asarray(read_image(path, record=record)), expected, orig)
    for kind, error in (("truncated", InputError), ("bomb", ImageTooLarge)):
        record, path, *_ = planted[kind]["docci"]
        with pytest.raises(error) as err:
            read_image(path, record=record)
        assert str(path) in str(err.value) and repr(record) in str(err.value)
    with pytest.raises(ImageTooLarge, match="decompression-bomb"):
        read_image(planted["bomb"]["docci"][1])

    # segments and lism: the bad DOCCI images are counted skips naming the file; the others are processed
    inprocess(proj, "segments")
    seg = proj.meta("data/prepared/segments.meta.json")
    assert {s["image_id"]: s["file"] for s in seg["skipped"]} == {
        planted[k]["docci"][0]: planted[k]["docci"][1].relative_to(proj.root).as_posix() for k in BAD}
    assert "decompression-bomb" in next(s["reason"] for s in seg["skipped"] if bad_docci[s["image_id"]] == "bomb")
    segments = pd.read_parquet(proj / "data/prepared/segments.parquet")
    good_ids = [planted[k]["docci"][0] for k in GOOD]
    assert set(good_ids) <= set(segments.image_id), "an odd but valid image lost its segments"
    inprocess(proj, "lism")
    lism = proj.meta("data/prepared/local_pairs.meta.json")
    assert {s["image_id"] for s in lism["skipped"]} == set(bad_docci)
    pairs = pd.read_parquet(proj / "data/prepared/local_pairs.parquet")
    train_ids = {r["example_id"] for r in docci_lines(proj) if r["split"] == "train"}
    assert set(good_ids) & train_ids <= set(pairs.image_id)

    # shards: the two truncated files are corrupt, the two bombs too large; everything else is written
    inprocess(proj, "shards")
    sh = proj.meta("data/shards/meta.json")
    assert (sh["images_skipped_corrupt"], sh["images_skipped_too_large"], sh["images_skipped_size_mismatch"]) == \
        (2, 2, 0)
    assert sh["samples_train"] + sh["samples_val"] == ref_sh["samples_train"] + ref_sh["samples_val"] - 4
    recs = shard_records(proj)
    in_shards = [(kind, source) for kind in GOOD for source in ("coco", "docci")   # DOCCI: train split only
                 if source == "coco" or planted[kind][source][0] in train_ids]
    assert len(in_shards) >= 7
    for kind, source in in_shards:
        rec = recs[f"{source}_{planted[kind][source][0]}"]
        assert (rec["width"], rec["height"]) == planted[kind][source][3].shape[1::-1]   # the stored frame
    for kind in BAD:
        assert f"coco_{planted[kind]['coco'][0]}" not in recs and f"docci_{planted[kind]['docci'][0]}" not in recs

    # the training loader decodes the shard bytes to the same pixels
    method = RecordingMethod()
    loader = ShardLoader(proj / "data/shards", "train", method, ExampleContext(lambda im: im, None, 64),
                         batch_size=2, train=False)
    for _ in loader.batches(0):
        pass
    assert loader.stats["corrupt_images_skipped"] == 0
    for kind, source in in_shards:
        record, _, expected, orig = planted[kind][source]
        assert_correct_pixels(f"{kind} ({source}, loader)", method.images[(source, str(record))], expected, orig)

    # eval's reader is the same reader
    for kind in GOOD:
        record, path, expected, orig = planted[kind]["coco"]
        assert_correct_pixels(f"{kind} (eval)", np.asarray(load_image(path, record=record)), expected, orig)
    for kind in BAD:
        record, path, *_ = planted[kind]["coco"]
        with pytest.raises(InputError) as err:
            load_image(path, record=record)
        assert str(path) in str(err.value)

    # pretrain reads its own split's images itself: a bad one there is a clear error naming file and image id
    pre = json.loads((proj / "data/sample/annotations/captions_pretrain.json").read_text())["images"][0]
    shutil.copyfile(planted[BAD[0]]["coco"][1], proj / "data/sample/images/pretrain" / pre["file_name"])
    with pytest.raises(InputError) as err:
        inprocess(proj, "pretrain")
    assert pre["file_name"] in str(err.value) and repr(pre["id"]) in str(err.value), str(err.value)


# ------------------------------------------------------------------------------------------ text
NON_LATIN = "一个红色的圆圈 🔴 и синий квадрат, دائرة حمراء 🙂"


def test_long_multilingual_and_crowd_annotations_through_the_text_stages(tiny_project, tmp_path, inprocess):
    from clipfinetune.data.loader import ExampleContext
    from clipfinetune.methods import build_method
    from clipfinetune.models import load_model

    ref_wr = tiny_project.meta("data/prepared/word_regions.meta.json")
    proj = tiny_project.clone(tmp_path / "p", ["data/sample", "models/base", *PREPARED,
                                               "data/prepared/segments.parquet"])
    caps, inst = load(proj, CAPTIONS), load(proj, INSTANCES)
    names = {c["id"]: c["name"] for c in inst["categories"]}
    img = min(i["id"] for i in caps["images"])
    cats = sorted({names[a["category_id"]] for a in inst["annotations"] if a["image_id"] == img})
    first, last = cats[0], cats[-1]
    # a 300-word caption: one category word at the start, one far beyond CLIP's 77 tokens
    long_caption = f"A {first} " + "very " * 295 + f"near a {last}."
    assert len(long_caption.split()) == 300
    mine = [a for a in caps["annotations"] if a["image_id"] == img]
    mine[0]["caption"], mine[1]["caption"] = long_caption, f"{NON_LATIN} a {first} 🎉"
    dump(proj, CAPTIONS, caps)
    # a crowd annotation in COCO's RLE form (pycocotools encodes it), over the whole image
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(np.ones((64, 64), np.uint8)))
    rle["counts"] = rle["counts"].decode()
    crowd = {"id": 10**6, "image_id": img, "category_id": inst["annotations"][0]["category_id"], "iscrowd": 1,
             "bbox": [0, 0, 64, 64], "area": 4096.0, "segmentation": rle}
    inst["annotations"].append(crowd)
    dump(proj, INSTANCES, inst)
    # a 40-sentence DOCCI description, and one in several scripts
    recs = docci_lines(proj)
    train = [r for r in recs if r["split"] == "train"]
    train[0]["description"] = " ".join(f"Sentence {i} tells of a small red circle." for i in range(40))
    train[1]["description"] = f"{NON_LATIN}. Это синий квадрат! 这是一个圆。 A red circle 🎉 sits on the left."
    write_docci(proj, recs)

    inprocess(proj, "word_regions")
    wr = proj.meta("data/prepared/word_regions.meta.json")
    assert wr["crowd_instances_ignored"] == ref_wr["crowd_instances_ignored"] + 1
    rows = pd.read_parquet(proj / "data/prepared/word_regions.parquet")
    assert not ((rows.image_id == img) & (rows.x1 - rows.x0 == 64) & (rows.y1 - rows.y0 == 64)).any()
    long_rows = rows[rows.caption == long_caption]
    assert set(long_rows.word.str.lower()) >= {first, last}
    for r in rows[rows.caption_id.isin([mine[0]["id"], mine[1]["id"]])].itertuples():   # str offsets, not bytes
        assert r.caption[r.char_start:r.char_end].lower() == r.word.lower()
    assert (rows[rows.caption_id == mine[1]["id"]].word.str.lower() == first).any()

    inprocess(proj, "sentences")
    sent_meta = proj.meta("data/prepared/sentences.meta.json")
    sents = pd.read_parquet(proj / "data/prepared/sentences.parquet")
    forty = sents[sents.image_id == train[0]["example_id"]]
    assert len(forty) == sent_meta["max_sentences"] and sent_meta["captions_over_cap"] >= 1
    multi = sents[sents.image_id == train[1]["example_id"]].sort_values("sentence_index")
    for r in multi.itertuples():
        assert r.long_caption[r.char_start:r.char_end] == r.text
    assert any("синий" in t for t in multi.text) and any("🎉" in t for t in multi.text)

    inprocess(proj, "negatives")        # every caption gets rewrites, or a counted rejection
    neg = pd.read_parquet(proj / "data/prepared/negatives.parquet")
    assert set(neg.caption) <= {a["caption"] for a in caps["annotations"]}
    inprocess(proj, "lism")
    pairs = pd.read_parquet(proj / "data/prepared/local_pairs.parquet")
    assert set(pairs[pairs.image_id == train[0]["example_id"]].sentence_index) == set(forty.sentence_index)
    assert train[1]["example_id"] in set(pairs.image_id)
    inprocess(proj, "shards")
    recs_out = shard_records(proj)
    coco_rec = recs_out[f"coco_{img}"]
    assert long_caption in coco_rec["captions"] and any(NON_LATIN in c for c in coco_rec["captions"])
    docci_rec = recs_out[f"docci_{train[1]['example_id']}"]
    assert docci_rec["long_caption"] == train[1]["description"]

    # the training examples: 77 tokens for CLIP-length methods; a word past the truncation has no token positions
    model = load_model("local-dir:" + str(proj / "models/base"))
    ctx = ExampleContext.of_model(model)
    image = Image.new("RGB", (coco_rec["width"], coco_rec["height"]))
    harmo = build_method("harmoclip")
    k_long = coco_rec["captions"].index(long_caption)
    for region in [r for r in coco_rec["word_regions"] if r["caption_index"] == k_long]:
        ex = harmo.make_example({**coco_rec, "word_regions": [region]}, image, random.Random(0), ctx)
        assert ex["text"].shape == (model.context_length,) == (77,)
        assert bool(ex["word_mask"].any()) == (region["char_span"][0] < 20), region   # "A <first>" vs the end
    goal = build_method("goal")
    for rec in (recs_out[f"docci_{train[0]['example_id']}"], docci_rec):
        if goal.wants(rec):
            ex = goal.make_example(rec, image, random.Random(0), ctx)
            assert all(torch.isfinite(v.float()).all() for v in ex.values() if torch.is_tensor(v))
    with open(proj / "data/shards/meta.json") as f:
        assert json.load(f)["empty_captions_skipped"] == 0
