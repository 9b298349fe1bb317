"""`clipfinetune data [<paper>] [--fetch]`: the real data a configuration reads, by dataset, and its download.

    clipfinetune data                 the applied params.yaml
    clipfinetune data <paper>         params.yaml + params.real.yaml + recipes/<paper>.yaml (what `recipe` writes)
    clipfinetune data <paper> --fetch download, verify and unpack what can be downloaded
    clipfinetune data --check         also parse every annotation file with the project's readers (slower)

The datasets come from one manifest, clipfinetune/project/datasets.yaml (source pages, licenses, sizes, counts,
checksums, manual steps). The table has one row per dataset the configuration reads: present, incomplete (what is
missing) or absent, with its size on disk and the size left to download; a needed path no dataset provides is listed
apart. A fetch downloads into datasets/.downloads/<file>.part with HTTP ranges (an interrupted download resumes from
what it holds, also in a later run), checks the size and the published sha256, unpacks into a temporary folder
beside the data and renames each file into place, then writes datasets/.fetched/<dataset>.json (what the archive
held: a fetched dataset is complete when those files are there). A re-run finds the datasets present and downloads
nothing. A failure (HTTP error, checksum, truncated archive, disk full) names the dataset and the URL and leaves every
complete dataset in place. The sources' base URL can point at a mirror: `--mirror URL` or $CLIPFINETUNE_DATA_MIRROR,
where https://host/path is read from URL/host/path.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import http.client
import json
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from clipfinetune.keys import lookup
from clipfinetune.project.formatting import fmt_bytes

MANIFEST = Path(__file__).with_name("datasets.yaml")
MIRROR_ENV = "CLIPFINETUNE_DATA_MIRROR"
MANIFEST_ENV = "CLIPFINETUNE_DATA_MANIFEST"   # another manifest (the tests' miniature counts)
DOWNLOADS = "datasets/.downloads"      # the .part files and verified archives, relative to the project root
STAMPS = "datasets/.fetched"           # one JSON per fetched dataset: what its archives held
FETCH_COMMAND = "clipfinetune data --fetch"
RETRIES = 3                            # a dropped connection is resumed this many times within one run
CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A download or unpack that failed: names the dataset and the URL."""

    def __init__(self, dataset: str, url: str, message: str):
        super().__init__(f"{dataset}: {url}: {message}")
        self.dataset, self.url = dataset, url


# ------------------------------------------------------------------------------------------------ the manifest
@dataclass
class Dataset:
    name: str
    title: str
    page: str
    license: str
    checked: str
    verified: bool
    size: str
    bytes: int
    paths: list[str]
    expect: dict
    fetch: list[dict] = field(default_factory=list)
    manual: str = ""
    note: str = ""
    roots: list[str] = field(default_factory=list)   # shared folders whose readers reach this dataset's files

    @property
    def fetchable(self) -> bool:
        return bool(self.fetch)


def _fill(node, name: str):
    if isinstance(node, str):
        return node.replace("{set}", name)
    if isinstance(node, list):
        return [_fill(x, name) for x in node]
    if isinstance(node, dict):
        return {_fill(k, name): _fill(v, name) for k, v in node.items()}
    return node


def _each(node, sets: list[str]):
    """Lists whose items name `{set}` expanded to one item per set (a dataset holding one file per set)."""
    if isinstance(node, list):
        out = []
        for x in node:
            out += [_fill(x, s) for s in sets] if "{set}" in json.dumps(x) else [_each(x, sets)]
        return out
    if isinstance(node, dict):
        return {k: _each(v, sets) for k, v in node.items()}
    return node


def load_manifest(path=MANIFEST) -> dict[str, Dataset]:
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    out = {}
    for name, entry in raw.items():
        entry = dict(entry)
        sets, each = entry.pop("sets", None), entry.pop("each_set", None)
        if sets and each == "datasets":
            for s in sets:
                out[f"{name}/{s}"] = Dataset(name=f"{name}/{s}", **_fill(entry, s))
        elif sets:
            out[name] = Dataset(name=name, **_each(entry, sets))
        else:
            out[name] = Dataset(name=name, **entry)
    return out


# ------------------------------------------------------------------------------------------------ what params read
def needed_paths(params: dict) -> list[tuple[str, str]]:
    """(params key, path) of every file or folder under the project the configuration reads: every source's paths
    (and `exclude` files), every configured evaluation set, SAM's checkpoint and LISM's matcher when their stages
    run."""
    from clipfinetune.data.readers import reader

    out = []
    sources = lookup(params, "sources", None) or {}
    for name in sorted(sources):   # every source, as validate checks and dvc.yaml's shards depends on coco's and
        spec = sources.get(name)   # docci's paths whatever the recipe trains on
        if not spec:
            continue
        for key in reader(spec["reader"]).PATHS:
            if spec.get(key):
                out.append((f"sources.{name}.{key}", str(spec[key])))
        for k, path in enumerate(spec.get("exclude") or []):
            out.append((f"sources.{name}.exclude[{k}]", str(path)))
    for task, sets in (lookup(params, "eval.evalsets", None) or {}).items():
        for set_name, cfg in (sets or {}).items():
            for key, value in _leaves(cfg, f"eval.evalsets.{task}.{set_name}"):
                out.append((key, value))
    if lookup(params, "segments.sources", None) and lookup(params, "segments.sam_checkpoint", None):
        out.append(("segments.sam_checkpoint", str(lookup(params, "segments.sam_checkpoint", None))))
    if lookup(params, "lism.sources", None) and lookup(params, "lism.model", None):
        out.append(("lism.model", str(lookup(params, "lism.model", None))))
    return [(k, os.path.normpath(v)) for k, v in out if "/" in v and not v.startswith(("data/", "models/"))]


def _leaves(cfg, prefix: str):
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            yield from _leaves(v, f"{prefix}.{k}")
    elif isinstance(cfg, str) and cfg:
        yield prefix, cfg


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def owners(path: str, manifest: dict[str, Dataset]) -> list[str]:
    """The datasets that provide `path`: the most specific one whose path holds it, else those naming it among their
    `roots` (a folder several datasets share, e.g. datasets/coco), else every one inside it."""
    holding = [(len(p), name) for name, d in manifest.items() for p in d.paths if _under(path, p)]
    if holding:
        return [max(holding)[1]]
    via = sorted(name for name, d in manifest.items() if path in d.roots)
    if via:
        return via
    return sorted({name for name, d in manifest.items() for p in d.paths if _under(p, path)})


def datasets_needed(params: dict, manifest: dict[str, Dataset]) -> tuple[dict[str, list[str]], list[tuple]]:
    """({dataset: [params keys reading it]}, [(key, path) no dataset provides])."""
    by_dataset: dict[str, list[str]] = {}
    unknown = []
    for key, path in needed_paths(params):
        names = owners(path, manifest)
        if not names:
            unknown.append((key, path))
        for name in names:
            keys = by_dataset.setdefault(name, [])
            if key not in keys:
                keys.append(key)
    return by_dataset, unknown


def missing_by_dataset(missing: list[tuple[str, str]], manifest: dict[str, Dataset] | None = None):
    """`clipfinetune plan`'s missing inputs grouped: [(dataset or None, [(key, path)], how to get it)] for the
    (params key, path) pairs that do not exist; a pair no dataset provides comes back alone with dataset None."""
    manifest = load_manifest() if manifest is None else manifest
    groups: dict[str, list] = {}
    alone = []
    for key, path in missing:
        names = owners(os.path.normpath(path), manifest)
        if not names:
            alone.append((None, [(key, path)], ""))
        for name in names:
            groups.setdefault(name, []).append((key, path))
    out = []
    for name, pairs in groups.items():
        d = manifest[name]
        how = FETCH_COMMAND if d.fetchable else f"manual: {d.page} (`clipfinetune data` prints the steps)"
        out.append((name, pairs, how))
    return out + alone


# ------------------------------------------------------------------------------------------------ status
@dataclass
class Status:
    name: str
    state: str                       # present | incomplete | absent
    missing: list[str]
    disk_bytes: int
    download_bytes: int | None       # None: unknown; 0: nothing to download


def _count_files(path: Path) -> int:
    n = 0
    for _, _, files in os.walk(path):
        n += len(files)
    return n


def _disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for folder, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(folder, f)).st_size
            except OSError:
                pass
    return total


def _stamp(root: Path, name: str) -> dict | None:
    path = root / STAMPS / f"{name.replace('/', '__')}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def parse_errors(d: Dataset, root: Path) -> list[str]:
    """The dataset's annotation files read with the project's own readers; each failure as text."""
    import contextlib

    out = []
    with contextlib.chdir(root):
        for check in d.expect.get("parse", []):
            try:
                if "source" in check:
                    from clipfinetune.data.readers import read_source

                    if not read_source(d.name, check["source"]):
                        out.append(f"{check['source']}: no records")
                elif "set" in check:
                    from clipfinetune.data.evalsets.sets import read_set

                    read_set(check["set"], check["cfg"], d.name)
                else:
                    for f in check["json"]:
                        text = Path(f).read_text()
                        if f.endswith((".jsonl", ".jsonlines")):
                            [json.loads(line) for line in text.splitlines() if line.strip()]
                        else:
                            json.loads(text)
            except Exception as e:  # noqa: BLE001  any reader failure is this dataset's, named below
                out.append(f"does not parse: {type(e).__name__}: {e}")
    return out


def status(d: Dataset, root: Path, check: bool = False) -> Status:
    root = Path(root)
    stamp = _stamp(root, d.name)
    missing, seen = [], 0
    for f in d.expect.get("files", []):
        if (root / f).is_file():
            seen += 1
        else:
            missing.append(f)
    for folder, want in d.expect.get("dirs", {}).items():
        full = root / folder
        if stamp and folder in stamp.get("dirs", {}):
            want = stamp["dirs"][folder]          # what the verified archive held
        have = _count_files(full) if full.is_dir() else 0
        seen += bool(have)
        if have < want:
            missing.append(f"{folder}: {have:,} of {want:,} files")
    if not missing and check:
        missing += parse_errors(d, root)
    disk = sum(_disk(root / p) for p in d.paths if (root / p).exists())
    state = "present" if not missing else ("incomplete" if seen else "absent")
    download = 0 if state == "present" else (d.bytes or None) if d.fetchable else None
    return Status(d.name, state, missing, disk, download)


# ------------------------------------------------------------------------------------------------ the table
def table(needed: dict[str, list[str]], unknown: list[tuple], manifest: dict[str, Dataset], root: Path,
          check: bool = False) -> tuple[str, list[Status]]:
    rows, statuses = [], []
    for name in sorted(needed):
        d = manifest[name]
        st = status(d, root, check)
        statuses.append(st)
        how = "fetch" if d.fetchable else "manual"
        keys = needed[name]
        rows.append([name, st.state, how, fmt_bytes(st.disk_bytes),
                     fmt_bytes(st.download_bytes, unknown="?") if st.state != "present" else "-",
                     keys[0] + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "")])
    head = ["dataset", "state", "how", "on disk", "to download", "read by"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
    lines = [fmt(head), fmt(["-" * w for w in widths]), *map(fmt, rows)]
    for st in statuses:
        if st.state == "absent":
            continue
        for m in st.missing[:5]:
            lines.append(f"  {st.name}: missing {m}")
        if len(st.missing) > 5:
            lines.append(f"  {st.name}: ... and {len(st.missing) - 5} more")
    manual = [manifest[s.name] for s in statuses if s.state != "present" and not manifest[s.name].fetchable]
    if manual:
        lines.append("manual steps (no direct download):")
        families: dict[str, list[Dataset]] = {}
        for d in manual:                          # a per-set family (zeroshot/<set>): its steps once
            families.setdefault(d.name.split("/")[0], []).append(d)
        for family, members in families.items():
            d = members[0]
            sets = [m.name.split("/", 1)[1] for m in members if "/" in m.name]
            steps, title = d.manual, d.title
            if sets:
                steps, title = steps.replace(sets[0], "<set>"), title.replace(sets[0], "<set>")
            lines.append(f"  {family} ({title}; {d.license})" + (f", sets: {', '.join(sets)}" if sets else "") + ":")
            lines += [f"    {x}" for x in steps.strip().splitlines()]
    for key, path in unknown:
        lines.append(f"  not in the manifest: {key}: {path}" + ("" if (root / path).exists() else " (missing)"))
    todo = [s for s in statuses if s.state != "present"]
    fetchable = [s for s in todo if manifest[s.name].fetchable]
    known = [s.download_bytes for s in fetchable if s.download_bytes]
    lines.append(f"{len(statuses) - len(todo)} of {len(statuses)} datasets present"
                 + (f"; {len(fetchable)} to fetch ({fmt_bytes(sum(known))}"
                    + (" + unknown sizes" if len(known) < len(fetchable) else "") + f"): {FETCH_COMMAND}"
                    if fetchable else "")
                 + (f"; {len(todo) - len(fetchable)} manual" if len(todo) > len(fetchable) else ""))
    return "\n".join(lines), statuses


# ------------------------------------------------------------------------------------------------ fetch
def mirrored(url: str, mirror: str | None) -> str:
    if not mirror:
        return url
    u = urlparse(url)
    return f"{mirror.rstrip('/')}/{u.netloc}{u.path}"


class _Progress:
    def __init__(self, label: str, total: int | None, start: int, out=sys.stderr):
        self.label, self.total, self.start, self.out = label, total, start, out
        self.t0 = self.last = time.monotonic()

    def __call__(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < 1.0:
            return
        self.last = now
        rate = (done - self.start) / max(now - self.t0, 1e-6)
        eta = ""
        if self.total and rate > 0:
            left = (self.total - done) / rate
            eta = f", ETA {int(left // 3600)}:{int(left % 3600 // 60):02d}:{int(left % 60):02d}"
        of = f" of {fmt_bytes(self.total)} ({100 * done / self.total:.0f}%)" if self.total else ""
        print(f"  {self.label}: {fmt_bytes(done)}{of}, {fmt_bytes(rate)}/s{eta}", file=self.out, flush=True)


def download(dataset: str, url: str, dest: Path, sha256: str = "", sha256_prefix: str = "",
             retries: int = RETRIES, timeout: float = 60.0, space_factor: int = 1) -> Path:
    """`url` into `dest` (via dest.part, resumed with an HTTP range from what it holds), size and checksum verified;
    the .part is renamed only when complete. A mismatch removes the .part (the next run starts over). Before a byte
    is written, the size the server reports (times `space_factor`: an archive is unpacked beside itself) must fit
    in the free space, or the download is refused as disk full."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    validator = part.with_name(part.name + ".validator")   # the ETag / Last-Modified the .part's bytes came with
    attempts = 0
    total = None
    while True:
        have = part.stat().st_size if part.exists() else 0
        headers = {}
        if have:
            headers["Range"] = f"bytes={have}-"
            if validator.is_file():             # the rest only if the file is unchanged, else the whole new file
                headers["If-Range"] = validator.read_text()
        req = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                if have and resp.status == 206:
                    total = _total(resp, have)
                    mode = "ab"
                else:                                   # no range support, a changed file or a fresh start
                    total, have, mode = _total(resp, 0), 0, "wb"
                _check_space(dataset, url, part.parent, ((total or have) - have) * space_factor)
                if mode == "wb":
                    _write_validator(validator, resp)
                progress = _Progress(f"{dataset} {dest.name}", total, have)
                done = have
                with open(part, mode) as f:
                    while True:
                        chunk = resp.read(CHUNK)
                        if not chunk:
                            break
                        f.write(chunk)
                        done += len(chunk)
                        progress(done)
                progress(done, final=True)
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:                  # the .part already holds the whole file
                total = have
            else:
                raise FetchError(dataset, url, f"HTTP {e.code} {e.reason}") from None
        except (OSError, http.client.HTTPException) as e:
            if getattr(e, "errno", None) == errno.ENOSPC:
                raise FetchError(dataset, url, f"disk full while writing {part}: free space, then re-run "
                                               f"`{FETCH_COMMAND}` (the download resumes)") from None
            attempts += 1
            if attempts > retries:
                raise FetchError(dataset, url, f"connection failed after {retries} retries ({e}); "
                                               f"{part} is kept: re-run to resume") from None
            print(f"  {dataset}: connection dropped ({e}); resuming", file=sys.stderr)
            continue
        size = part.stat().st_size
        if total is not None and size < total:          # the server closed early: resume
            attempts += 1
            if attempts > retries:
                raise FetchError(dataset, url, f"truncated: {size} of {total} bytes after {retries} retries; "
                                               f"{part} is kept: re-run to resume")
            print(f"  {dataset}: {size} of {total} bytes, the connection closed early; resuming", file=sys.stderr)
            continue
        break
    validator.unlink(missing_ok=True)
    digest = _sha256(part) if sha256 or sha256_prefix else ""
    if sha256 and digest != sha256 or sha256_prefix and not digest.startswith(sha256_prefix):
        part.unlink()
        raise FetchError(dataset, url, f"checksum mismatch: sha256 {digest}, the source publishes "
                                       f"{sha256 or sha256_prefix + '...'}; the download was removed")
    os.replace(part, dest)
    return dest


def _write_validator(path: Path, resp) -> None:
    """A strong ETag, else Last-Modified (RFC 9110 If-Range takes either); none: the resume asks for a plain range."""
    etag = resp.headers.get("ETag", "")
    value = etag if etag and not etag.startswith("W/") else resp.headers.get("Last-Modified", "")
    if value:
        path.write_text(value)
    else:
        path.unlink(missing_ok=True)


def _check_space(dataset: str, url: str, folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if needed > 0 and free < needed:
        raise FetchError(dataset, url, f"disk full: {fmt_bytes(free)} free under {folder}, about "
                                       f"{fmt_bytes(needed)} needed (archive + unpacked); free space, then re-run "
                                       f"`{FETCH_COMMAND}`")


def _total(resp, offset: int) -> int | None:
    rng = resp.headers.get("Content-Range", "")
    if "/" in rng and not rng.endswith("/*"):
        return int(rng.rsplit("/", 1)[1])
    length = resp.headers.get("Content-Length")
    return offset + int(length) if length is not None else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _members_kept(name: str, item: dict) -> str | None:
    """The member's path after `strip`, or None when `only` leaves it out (or it escapes the target)."""
    strip = item.get("strip", "")
    if strip:
        if not name.startswith(strip):
            return None
        name = name[len(strip):]
    only = item.get("only")
    if only and not any(name == o or o.endswith("/") and name.startswith(o) for o in only):
        return None
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts:
        return None
    return name


def unpack(dataset: str, url: str, archive: Path, item: dict, into: Path) -> None:
    """Extract the kept members of `archive` into `into` (a fresh folder); a broken archive is a FetchError."""
    try:
        if item["kind"] == "zip":
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    rel = _members_kept(info.filename, item)
                    if rel is None or info.is_dir():
                        continue
                    target = into / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with z.open(info) as src, open(target, "wb") as dst:     # CRC checked at the end of the read
                        shutil.copyfileobj(src, dst, CHUNK)
        else:
            with tarfile.open(archive, "r:*") as t:
                for member in t:
                    rel = _members_kept(member.name, item)
                    if rel is None or not member.isfile():
                        continue
                    target = into / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with t.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst, CHUNK)
        for inner in item.get("nested", []):
            inner_path = into / inner
            unpack(dataset, url, inner_path, {"kind": "zip"}, inner_path.parent)
            inner_path.unlink()
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error, KeyError) as e:
        raise FetchError(dataset, url, f"broken archive {archive.name}: {type(e).__name__}: {e}; it was removed, "
                                       "re-run to download it again") from None
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise FetchError(dataset, url, f"disk full while unpacking {archive.name}") from None
        raise


def _place(src: Path, dst: Path) -> None:
    """`src` renamed to `dst`; across file systems (a folder under datasets/ linked elsewhere) copied to a temporary
    name beside `dst` first, so `dst` is never half-written."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.part")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        src.unlink()


def _move_into_place(tmp: Path, root: Path) -> list[str]:
    """Every file under tmp renamed to the same relative path under root (atomic per file)."""
    moved = []
    for folder, _, files in os.walk(tmp):
        for f in files:
            src = Path(folder) / f
            rel = src.relative_to(tmp)
            _place(src, root / rel)
            moved.append(str(rel))
    return moved


@contextlib.contextmanager
def fetch_lock(d: Dataset, root: Path):
    """One fetch of a dataset at a time into one datasets/ folder (two shells, or several nodes on a shared file
    system): datasets/.fetched/<dataset>.lock, held with flock; a second fetch says who holds it and waits."""
    path = Path(root) / STAMPS / f"{d.name.replace('/', '__')}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            print(f"  {d.name}: being fetched by {holder}; waiting for it to finish", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch_dataset(d: Dataset, root: Path, mirror: str | None = None, retries: int = RETRIES) -> dict:
    """Download, verify and unpack every file of `d`; on success write its stamp. Raises FetchError."""
    root = Path(root)
    downloads = root / DOWNLOADS
    stage = root / "datasets" / ".tmp"
    stage.mkdir(parents=True, exist_ok=True)
    prefix = d.name.replace("/", "__") + "-"
    for stale in stage.glob(prefix + "*"):              # left by a run killed while unpacking
        shutil.rmtree(stale, ignore_errors=True)
    files = []
    for item in d.fetch:
        url = mirrored(item["url"], mirror)
        archive = downloads / PurePosixPath(urlparse(item["url"]).path).name
        if not archive.is_file():
            download(d.name, url, archive, item.get("sha256", ""), item.get("sha256_prefix", ""), retries,
                     space_factor=1 if item["kind"] == "file" else 2)
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=stage))
        try:
            if item["kind"] == "file":          # verified under its .part name: renamed into place
                _place(archive, tmp / item["into"])
            else:
                try:
                    unpack(d.name, url, archive, item, tmp / item["into"])
                except FetchError:
                    archive.unlink(missing_ok=True)
                    raise
            files += _move_into_place(tmp, root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        archive.unlink(missing_ok=True)                # unpacked: the archive is not kept
    dirs = {folder: _count_files(root / folder) for folder in d.expect.get("dirs", {})}
    stamp = {"dataset": d.name, "urls": [i["url"] for i in d.fetch], "mirror": mirror or "",
             "fetched": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "files": len(files), "dirs": dirs}
    path = root / STAMPS / f"{d.name.replace('/', '__')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_stamp = path.with_suffix(".tmp")
    tmp_stamp.write_text(json.dumps(stamp, indent=1))
    os.replace(tmp_stamp, path)
    return stamp


def layout_table(path=MANIFEST) -> str:
    """docs/real-data.md's layout table, one row per manifest entry (`python -m clipfinetune.project.data --table`)."""
    import yaml

    lines = ["| dataset | layout under the project | source | how |", "|---|---|---|---|"]
    for name, e in yaml.safe_load(Path(path).read_text()).items():
        how = "`clipfinetune data --fetch`" if e.get("fetch") else "manual (steps in `clipfinetune data`)"
        how += "" if e.get("verified") else ", unverified"
        lines.append(f"| `{name}` | {', '.join(f'`{p}`' for p in e['paths'])} | {e['page']} ({e['size']}) | {how} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ command line
def params_for(paper: str | None, root: Path, params_file: Path) -> dict:
    from clipfinetune.project import profile

    if not paper:
        return profile.load_plain(params_file) if params_file.is_file() else {}
    try:                  # the base `clipfinetune recipe` applies the recipe over (no other recipe's leftovers)
        base = profile.loads(profile.committed_base(params_file)[0])
    except (SystemExit, Exception):  # noqa: BLE001  no git history: the workspace's params.yaml
        base = profile.load_plain(params_file) if params_file.is_file() else {}
    found = profile.recipes(root)
    if paper not in found:
        raise SystemExit(f"clipfinetune data: no recipe {paper!r} (recipes: {', '.join(sorted(found))})")
    return profile.layered(base, profile.load_plain(root / "params.real.yaml"), found[paper][1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="clipfinetune data", description=__doc__.splitlines()[0])
    p.add_argument("paper", nargs="?", help="a recipe (recipes/<paper>.yaml); default: the applied params.yaml")
    p.add_argument("--fetch", action="store_true", help="download, verify and unpack what can be downloaded")
    p.add_argument("--check", action="store_true", help="also parse the annotation files with the project's readers")
    p.add_argument("--mirror", default=os.environ.get(MIRROR_ENV, ""),
                   help=f"base URL replacing the sources' hosts (default ${MIRROR_ENV})")
    p.add_argument("--root", default=".", help="project root (default: here)")
    p.add_argument("--params", default=None, help="params file (default <root>/params.yaml)")
    p.add_argument("--manifest", default=os.environ.get(MANIFEST_ENV, str(MANIFEST)), help=argparse.SUPPRESS)
    p.add_argument("--table", action="store_true", help="print docs/real-data.md's layout table and exit")
    args = p.parse_args(argv)
    if args.table:
        print(layout_table(args.manifest))
        return 0
    root = Path(args.root)
    manifest = load_manifest(args.manifest)
    params = params_for(args.paper, root, Path(args.params) if args.params else root / "params.yaml")
    needed, unknown = datasets_needed(params, manifest)
    what = f"recipe {args.paper}" if args.paper else "params.yaml"
    print(f"clipfinetune data: {len(needed)} datasets read by {what} (manifest checked {_checked(manifest, needed)})")
    if not needed and not unknown:
        print("nothing under datasets/ is read (the sample world builds its own data): `clipfinetune data <paper>` "
              f"names a recipe's ({', '.join(sorted(profile_recipes(root)))})")
        return 0
    text, statuses = table(needed, unknown, manifest, root, args.check)
    if not args.fetch:
        print(text)
        return 0 if all(s.state == "present" for s in statuses) else 1
    failed = []
    for st in statuses:
        d = manifest[st.name]
        if st.state == "present" or not d.fetchable:
            continue
        print(f"fetching {d.name}: {', '.join(i['url'] for i in d.fetch)}", file=sys.stderr, flush=True)
        try:
            with fetch_lock(d, root):
                if status(d, root).state != "present":     # else another fetch completed it while this one waited
                    fetch_dataset(d, root, args.mirror)
        except FetchError as e:
            failed.append(e)
            print(f"ERROR {e}", file=sys.stderr)
    text, statuses = table(needed, unknown, manifest, root, check=True)
    print(text)
    for e in failed:
        print(f"FAILED {e}")
    return 0 if not failed and all(s.state == "present" for s in statuses) else 1


def profile_recipes(root: Path) -> dict:
    from clipfinetune.project import profile

    return profile.recipes(root)


def _checked(manifest, needed) -> str:
    days = sorted({manifest[n].checked for n in needed})
    return ", ".join(str(d) for d in days) or "-"


if __name__ == "__main__":
    sys.exit(main())
