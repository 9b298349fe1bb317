"""Urban1k reader: caption/<n>.txt (the caption is the first line) and image/<n>.jpg, in numeric order of n
(names that are not numbers after them, by name). A test set: split "test"."""
from __future__ import annotations

from pathlib import Path

from clipfinetune.io import InputError, decode_utf8

KEYS = ("root", "splits")
PATHS = ("root",)


def _order(p: Path):
    return (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0, p.stem)


def read(root, splits=None, source: str = "urban1k", counts=None):
    from clipfinetune.data.readers import Record

    root = Path(root)
    files = sorted((root / "caption").glob("*.txt"), key=_order)
    if not files:
        raise InputError(root / "caption", None, "no caption files")
    return [Record(source=source, image_id=p.stem, image=f"{p.stem}.jpg", images_root=root / "image", split="test",
                   long_caption=(decode_utf8(p.read_bytes(), p).splitlines() or [""])[0], origin=str(p))
            for p in files]
