"""Long-caption retrieval sets (DOCCI, DCI, Urban1k, GOAL lists, docs/evalsets.md §3): one caption per image ->
`RetrievalSet` (the evaluation is `clipfinetune.eval.long_retrieval`)."""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.data.evalsets.images import ImageResolver, resolve_image
from clipfinetune.data.evalsets.retrieval import RetrievalSet
from clipfinetune.data.readers import dci, docci, urban1k
from clipfinetune.io import InputError


def records_set(records, check_empty: bool = True) -> RetrievalSet:
    """Reader `Record`s (one long caption each) -> a RetrievalSet in the records' order; images resolved under
    each record's images root (`resolve_image`); an empty caption is an error naming the file and the record."""
    out = RetrievalSet([])
    for r in records:
        if check_empty and not str(r.long_caption).strip():
            raise InputError(r.origin, r.image_id, "empty caption")
        root = r.images_root
        out.add(resolve_image(r.image, str(root) if root is not None else None, r.image_id), [r.long_caption])
    return out


def read_docci(path, images_root, split: str = "test", splits=None) -> RetrievalSet:
    """DOCCI (`readers.docci`): the records of `splits` (default: just `split`), in file order (GOAL's DOCCI
    numbers use test + qual_test, 5,100 images: `splits: [test, qual_test]`)."""
    wanted = [split] if splits is None else [splits] if isinstance(splits, str) else list(splits)
    records = docci.read(path, images_root, splits=wanted)
    if not records:
        raise InputError(path, None, f"no records of split(s) {wanted}")
    return records_set(records)


def read_dci(root, split: str = "test", field: str = "extra_caption") -> RetrievalSet:
    """DCI (`readers.dci`): caption = `extra_caption` (what GOAL's DCI test file holds) or field == "complete"
    for DCI's full formatted description."""
    return records_set(dci.read(root, splits=[split], field=field))


def read_urban1k(root) -> RetrievalSet:
    """Urban1k (`readers.urban1k`): caption = the first line of caption/<n>.txt, ordered by n."""
    return records_set(urban1k.read(root))


def read_goal_list(path, images_root) -> RetrievalSet:
    """GOAL `{docci,DCI,urban_dataset}_test.json`: [{"filename", "caption"}], image i <-> caption i.
    The shipped placeholder prefixes are resolved by trailing path under `images_root` (`ImageResolver`: two
    entries landing on one file are an error)."""
    out, resolve = RetrievalSet([]), ImageResolver(path)
    for i, rec in enumerate(json.loads(Path(path).read_text())):
        out.add(resolve(rec["filename"], images_root, i), [rec["caption"]])
    return out


def load_long_set(cfg: dict) -> RetrievalSet:
    """`eval.evalsets.long_retrieval.<set>`: one of `docci` (+ images), `dci` (root), `urban1k`
    (root), `goal_list` (+ images); optional `split` (`splits` list for DOCCI), `dci_field`."""
    if cfg.get("docci"):
        return read_docci(cfg["docci"], cfg.get("images"), cfg.get("split", "test"), cfg.get("splits"))
    if cfg.get("dci"):
        return read_dci(cfg["dci"], cfg.get("split", "test"), cfg.get("dci_field", "extra_caption"))
    if cfg.get("urban1k"):
        return read_urban1k(cfg["urban1k"])
    if cfg.get("goal_list"):
        return read_goal_list(cfg["goal_list"], cfg.get("images"))
    raise ValueError(f"long_retrieval benchmark needs one of docci|dci|urban1k|goal_list, got {sorted(cfg)}")
