"""DCI reader (`densely_captioned_images/`: complete/<key>.json with `image`, `extra_caption`, ...; splits.json;
photos/<image>).

GOAL's long text is DCI's `extra_caption` (docs/evalsets.md §3.2); `field="complete"` gives DCI's own formatted complete
description instead. image_id = the entry key's stem; `splits` selects by splits.json (default: every entry in
complete/, split "").
"""
from __future__ import annotations

import json
from pathlib import Path

from clipfinetune.io import InputError

KEYS = ("root", "splits", "field")
PATHS = ("root",)


def complete_description(rec: dict) -> str:
    """DCI `get_formatted_complete_description`: short + "\\n" + extra (+ mask captions; quality 2 skipped)."""
    text = rec["short_caption"] + "\n" + rec["extra_caption"]
    masks = []
    for key in rec.get("mask_keys", []):
        m = rec["mask_data"][key]
        if m.get("mask_quality") == 0:
            masks.append(f"{m['label']}: {m['caption']}")
        elif m.get("mask_quality") == 1:
            masks.append(m["label"])
    if masks:
        text += "\nThe following can also be seen in the image:\n" + "\n".join(masks)
    return text


def _entries(root: Path, splits) -> list[tuple[str, str]]:
    if splits is None:
        return [(p.name, "") for p in sorted((root / "complete").glob("*.json"))]
    try:
        table = json.loads((root / "splits.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(root / "splits.json", None, f"unreadable DCI splits file: {e}") from e
    out = []
    for split in [splits] if isinstance(splits, str) else splits:
        if split not in table:
            raise InputError(root / "splits.json", split, "no such split")
        out += [(key, split) for key in table[split]]
    return out


def read(root, splits=None, field: str = "extra_caption", source: str = "dci", counts=None):
    from clipfinetune.data.readers import Record

    root, out = Path(root), []
    for key, split in _entries(root, splits):
        p = root / "complete" / key
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(p, key, f"unreadable DCI entry: {e}") from e
        if "image" not in data or "extra_caption" not in data:
            raise InputError(p, key, "DCI entry lacks `image` or `extra_caption`")
        text = complete_description(data) if field == "complete" else data[field]
        out.append(Record(source=source, image_id=Path(key).stem, image=str(data["image"]),
                          images_root=root / "photos", split=split, long_caption=text, origin=str(p)))
    return out
