"""Image names in benchmark annotation files -> files on disk: the one rule every set reader resolves them by."""
from __future__ import annotations

import os
from pathlib import Path

from clipfinetune.io import InputError


def resolve_image(name: str, root: str | os.PathLike | None, record=None) -> str:
    """Find an image named in an annotation file: `root/name`, else `name` as given, else the name's trailing
    path under `root`, longest first (`root/b/c.jpg`, then `root/c.jpg` for "a/b/c.jpg"): lists that ship a
    placeholder prefix (GOAL's "chage/path/to/...") keep their distinguishing folders, so crops that share a
    file name in their own folders stay apart. A whole list checks for collisions with `ImageResolver`."""
    candidates = []
    if root:
        candidates.append(Path(root) / name)
    candidates.append(Path(name))
    if root:
        parts = Path(name).parts
        candidates += [Path(root).joinpath(*parts[k:]) for k in range(1, len(parts))]
    for c in candidates:
        if c.is_file():
            return str(c)
    raise InputError(candidates[0], record, f"image not found (also tried {[str(c) for c in candidates[1:]]})")


class AmbiguousImageName(InputError):
    """Two names of one list resolve to the same file (never swallowed by a caller trying other roots)."""


class ImageResolver:
    """`resolve_image` over one annotation list that refuses ambiguity: two different names of the list that
    land on the same file (e.g. crops all named `original_image.jpg` in their own folders, found by file name
    alone because their folders are not under the images root) are an error naming the list and both records."""

    def __init__(self, list_path):
        self.list_path = list_path
        self._seen: dict[str, tuple[str, object]] = {}     # resolved file -> (name, record) that first reached it

    def __call__(self, name: str, root, record=None) -> str:
        found = resolve_image(name, root, record)
        first = self._seen.setdefault(found, (name, record))
        if first[0] != name:
            raise AmbiguousImageName(self.list_path, record,
                             f"{name!r} and {first[0]!r} (record {first[1]}) both resolve to {found}: ambiguous "
                             f"file name; point the images root at the folder that holds their own sub-folders")
        return found
