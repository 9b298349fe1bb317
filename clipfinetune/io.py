"""Atomic outputs and clear input errors, shared by every stage."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class InputError(ValueError):
    """Bad input that cannot be skipped: names the file and the record."""

    def __init__(self, path: str | os.PathLike, record: Any, message: str):
        self.path, self.record = str(path), record
        super().__init__(f"{path}: record {record!r}: {message}")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `path`; rename it over `path` only if the block succeeds.

    A killed process leaves at most a `.tmp-*` sibling, never a half-written `path`: an existing folder is
    first renamed aside (then deleted), so a kill while it is being replaced leaves `path` absent, never half
    deleted. Temporary names carry the host and pid; leftovers of dead processes of this host are removed
    on the next write of the same `path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    tag = f".tmp-{path.name}-{_HOST}-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=path.parent)) if is_dir else path.with_name(tag)
    try:
        yield tmp
        if is_dir and path.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{tag}-old-", dir=path.parent))
            os.replace(path, old)             # atomic: `path` is whole or absent, never half deleted
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


_HOST = re.sub(r"[^A-Za-z0-9]+", "_", socket.gethostname()) or "host"


def _remove_stale_temporaries(path: Path) -> None:
    """Delete `.tmp-<name>-<this host>-<pid>*` siblings whose process is gone (a killed earlier write)."""
    pattern = re.compile(rf"\.tmp-{re.escape(path.name)}-{re.escape(_HOST)}-(\d+)(-.*)?$")
    try:
        siblings = list(path.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        m = pattern.match(p.name)
        if not m or _alive(int(m.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:               # e.g. EPERM: it exists, owned by someone else
        return True
    return True


def write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=indent, sort_keys=True, default=_json_default) + "\n")


def copy_dir(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Replace folder `dst` by a copy of folder `src`, atomically (whole or absent, never half copied)."""
    with atomic_path(dst, is_dir=True) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_parquet(path: str | os.PathLike, frame, metadata: dict[str, str] | None = None) -> None:
    """Deterministic parquet (no pandas index, fixed writer) written atomically; `metadata`: the schema's key-values."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = frame if isinstance(frame, pa.Table) else pa.Table.from_pandas(frame, preserve_index=False)
    table = table.replace_schema_metadata(metadata)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, (np.ndarray,)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


# ------------------------------------------------------------------------------------------ reading text
_ID_KEYS = ("id", "example_id", "image_id")


def decode_utf8(data: bytes, path: str | os.PathLike, record: Any = None) -> str:
    """`data` as UTF-8 text, or an InputError naming the file and the record holding the first bad byte (the
    id of the innermost JSON object whose string carries it; else `record`, else the byte offset)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        found, rid = _undecodable_owner(data)
        where = rid if found and rid is not None else record if record is not None else f"byte {e.start}"
        raise InputError(path, where, f"not UTF-8 text: byte {data[e.start:e.start + 1]!r} at offset {e.start} "
                                      f"(re-encode the file as UTF-8)") from None


def _undecodable_owner(data: bytes) -> tuple[bool, Any]:
    try:
        obj = json.loads(data.decode("utf-8", "surrogateescape"))
    except ValueError:
        return False, None

    def walk(node, owner):
        if isinstance(node, dict):
            owner = next((node[k] for k in _ID_KEYS if isinstance(node.get(k), (int, str))), owner)
            items = node.values()
        elif isinstance(node, list):
            items = node
        else:
            return (True, owner) if isinstance(node, str) and any("\udc80" <= c <= "\udcff" for c in node) \
                else (False, None)
        for v in items:
            hit = walk(v, owner)
            if hit[0]:
                return hit
        return False, None

    return walk(obj, None)


def read_jsonlines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, object) of every non-blank line; a line that is not UTF-8 or not JSON is an InputError
    naming the file and the record (its example_id/id when readable, else the line)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(path, None, "file not found")
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, f"line {n}")
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(path, f"line {n}", f"not valid JSON: {e}") from e


# ------------------------------------------------------------------------------------------ reading images
class ImageTooLarge(InputError):
    """An image above PIL's decompression-bomb limit (`PIL.Image.MAX_IMAGE_PIXELS`)."""


def read_image(source: str | os.PathLike | bytes, path: str | os.PathLike | None = None, record: Any = None):
    """The one way an image is opened: a decoded RGB PIL image, or an InputError naming the file and record.

    - Pixels stay in the **stored frame**: an EXIF orientation tag is not applied (COCO's boxes, PIL and
      open_clip all use the stored frame), so boxes on disk and pixels always agree.
    - Modes: 16-bit greyscale (`I;16*`, `I`) is scaled to 8 bits (PIL's own conversion clips it to white);
      CMYK, greyscale, palette and 1-bit go through PIL's conversion; transparency (RGBA, LA, PA, or a palette /
      greyscale with a transparent colour) is composited onto white.
    - Images above PIL's decompression-bomb limit are refused (`ImageTooLarge`) before any pixel is decoded;
      truncated or corrupt files raise InputError (a truncated image is never padded with grey).
    `source` is a path or the encoded bytes (then `path` names where they came from).
    """
    return _decode(source, path, record, draft=False)[0]


def checked_image_size(source: str | os.PathLike | bytes, path: str | os.PathLike | None = None,
                       record: Any = None) -> tuple[int, int]:
    """(width, height) in the stored frame, after the checks and conversion `read_image` does (JPEGs decoded at
    1/8 scale, which still reads every byte): an image this accepts, `read_image` reads."""
    return _decode(source, path, record, draft=True)[1]


def _decode(source, path, record, draft: bool):
    import io as _io
    import warnings

    from PIL import Image

    where = path if path is not None else "<bytes>" if isinstance(source, bytes) else source
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # refused below, with file and record
            im = Image.open(_io.BytesIO(source) if isinstance(source, bytes) else source)
        with im:
            limit = Image.MAX_IMAGE_PIXELS
            if limit and im.width * im.height > limit:
                raise ImageTooLarge(where, record, f"{im.width}x{im.height} pixels is above PIL's decompression-"
                                                   f"bomb limit of {limit} (PIL.Image.MAX_IMAGE_PIXELS)")
            stored_size = im.size
            if draft and im.format == "JPEG":
                im.draft("RGB", (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
            return _to_rgb(im), stored_size
    except InputError:
        raise
    except FileNotFoundError:
        raise InputError(where, record, "image file not found") from None
    except Image.DecompressionBombError as e:      # > 2x the limit: PIL refuses at open
        raise ImageTooLarge(where, record, f"above PIL's decompression-bomb limit: {e}") from None
    except Exception as e:   # noqa: BLE001 - PIL's plugins raise many types on corrupt data (OSError, SyntaxError,
        raise InputError(where, record, f"unreadable image: {e}") from None   # EOFError, struct.error, ...)


def _to_rgb(im):
    import numpy as np
    from PIL import Image

    if im.mode.startswith("I;16") or im.mode == "I":
        # 16-bit samples: keep the top 8 bits (PIL's convert("L") would clip every value above 255 to white)
        wide = np.asarray(im, dtype=np.int64) if im.mode == "I" else np.asarray(im).astype(np.int64)
        return Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8), "L").convert("RGB")
    if im.mode == "F":
        return Image.fromarray(np.clip(np.asarray(im), 0, 255).astype(np.uint8), "L").convert("RGB")
    has_alpha = im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    if has_alpha:
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    # convert() of an RGB image is a copy of every pixel (a tenth of a loader worker's time on a 640 x 480 JPEG)
    return im if im.mode == "RGB" else im.convert("RGB")
