"""Readers: one module per annotation format, each producing `Record`s; every consumer (data stages, `pretrain`,
evaluation) reads a format only through its reader, so a format's rules (which split, which caption, the order of
captions) are decided once.

A *source* (params.yaml `sources.<name>`) names a reader and that reader's path keys:
`{reader: coco, captions: ..., images: ...}`; `read_source(name, spec)` reads it. The keys of a reader are its
`read()` keyword arguments; `PATHS` lists those that are files or folders (what dvc.yaml declares as deps).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path

# reader name -> module under clipfinetune.data.readers (each defines `read(source=..., **keys)` and `PATHS`)
READERS = ("coco", "karpathy", "docci", "dci", "urban1k", "sharegpt4v", "pairs", "wds")


@dataclass(frozen=True)
class Record:
    """One image and its text, whatever the format. Absent fields are empty, never missing."""
    source: str                       # the source's name (params `sources.<name>`); the shard key's prefix
    image_id: str                     # unique within the source
    image: str                        # the image as the annotation names it (relative to `images_root`)
    images_root: Path | None = None   # the folder `image` is relative to (None: `image` is a path as given)
    split: str = ""                   # the format's split ("" when it has none)
    captions: tuple[str, ...] = ()    # short captions; position = caption_index
    long_caption: str = ""            # one long description (DOCCI, DCI, Urban1k, ShareGPT4V)
    size: tuple[int, int] | None = None   # (width, height) when the format states it
    data: bytes | None = None         # the image file's bytes when the format stores them (WebDataset)
    origin: str = ""                  # the annotation file it came from (for error messages)
    extra: dict = field(default_factory=dict, compare=False)   # the format's other per-image fields (COCO:
                                      # images[] keys beyond id/file_name/size, e.g. the sample pretraining labels)

    @property
    def path(self) -> Path:
        return Path(self.images_root) / self.image if self.images_root is not None else Path(self.image)

    def read_image(self):
        """The decoded RGB image (`clipfinetune.io.read_image`): an InputError names the file and the record."""
        from clipfinetune.io import read_image

        return read_image(self.data if self.data is not None else self.path, path=self.path, record=self.image_id)

    def image_bytes(self) -> bytes:
        return self.data if self.data is not None else self.path.read_bytes()


def reader(name: str):
    if name not in READERS:
        raise ValueError(f"unknown reader {name!r}; known: {', '.join(READERS)}")
    return importlib.import_module(f"{__name__}.{name}")


def read_source(name: str, spec: dict, counts=None) -> list[Record]:
    """The records of source `name`: `spec` = params `sources.<name>` ({reader: ..., <its keys>}); skips the
    reader counts (e.g. empty captions) go into the Counter `counts` when given."""
    spec = dict(spec)
    try:
        kind = spec.pop("reader")
    except KeyError:
        raise ValueError(f"sources.{name}: no `reader` (one of {', '.join(READERS)})") from None
    module = reader(kind)
    unknown = set(spec) - set(module.KEYS)
    if unknown:
        raise ValueError(f"sources.{name}: reader {kind!r} takes {sorted(module.KEYS)}, not {sorted(unknown)}")
    return module.read(source=name, counts=counts, **spec)


def read_sources(names, specs: dict, counts=None) -> dict[str, list[Record]]:
    """{name: records} for the source names a stage lists (params `<stage>.sources`)."""
    missing = [n for n in names if n not in specs]
    if missing:
        raise ValueError(f"sources {missing} are not defined under params `sources` (defined: {sorted(specs)})")
    return {n: read_source(n, specs[n], counts) for n in names}


def source_paths(spec: dict) -> list[str]:
    """The files and folders a source reads (its dvc deps; what `validate` checks)."""
    module = reader(spec["reader"])
    return [str(spec[k]) for k in module.PATHS if spec.get(k)]


def in_splits(record: Record, splits) -> bool:
    """The one split rule: a record without a split belongs to every selection; otherwise its split must be listed."""
    return splits is None or not record.split or record.split in splits
