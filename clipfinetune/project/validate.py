"""Check a params file before anything runs: every configured path, weight and endpoint.

    python -m clipfinetune.project.validate [--params params.yaml] [--root .] [--timeout 5]

Names everything missing (one line each: the param key, what was expected, where) and exits 1 if anything is;
notes (e.g. a CPU fallback in use, open_clip weights not cached yet) do not fail. Paths that a pipeline stage
produces (outs in dvc.yaml, e.g. models/base, data/prepared/...) are not required to exist yet. Training images that
a configured evaluation set scores (same COCO id or same bytes, `clipfinetune.leakage`) are an error naming the
set, the count and the first ids.

`check(params, root)` is the library entry: it takes the params as a dict and reads no file on its own; only the
command line reads the params file it is given.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from clipfinetune.keys import BothSpellings, lookup, respell

FILE_SUFFIXES = (".json", ".jsonl", ".jsonlines", ".parquet", ".pt", ".pth", ".safetensors", ".bin", ".txt", ".tsv")
DIR_KEYS = ("images", "dir", "dci", "urban1k", "coco_order_images")
# (param key, kind) of the single-path params; kind: file | dir | any
PATH_PARAMS = [("lism.sentences", "file"), ("lism.segments", "file"), ("lism.ground_truth", "file")]
SOURCE_DIR_KEYS = ("images", "root")     # the other path keys of a source (readers' PATHS) are files


def source_path_params(params: dict) -> list[tuple[str, str]]:
    """(param key, kind) of every path of every source (`sources.<name>.<key>`, the keys its reader lists)."""
    from clipfinetune.data.readers import reader

    out = []
    for name, spec in (params.get("sources") or {}).items():
        for key in reader(spec["reader"]).PATHS:
            out.append((f"sources.{name}.{key}", "dir" if key in SOURCE_DIR_KEYS else "file"))
    return out


@dataclass
class Finding:
    key: str
    message: str
    missing: bool = True

    def __str__(self):
        return f"{'MISSING' if self.missing else 'note'}  {self.key}: {self.message}"


def _get(params: dict, key: str):
    return lookup(params, key, None)


def produced_paths(root: Path) -> list[str]:
    """Outputs of the pipeline's stages (dvc.yaml beside the params), which need not exist before `dvc repro`."""
    if not (root / "dvc.yaml").is_file():
        return []
    try:
        from dvc.repo import Repo

        with Repo(str(root)) as repo:
            return [str(Path(o.fs_path).relative_to(root.resolve())) for o in repo.index.outs]
    except Exception:  # noqa: BLE001  not a DVC repo (a bare copy of the params): every path must exist
        return []


def _is_produced(path: str, produced: list[str]) -> bool:
    p = Path(path)
    return not p.is_absolute() and any(p == Path(o) or Path(o) in p.parents for o in produced)


def check_path(key: str, value, kind: str, root: Path, produced: list[str]) -> list[Finding]:
    if value in (None, ""):
        return []
    path = Path(str(value)).expanduser()
    full = path if path.is_absolute() else root / path
    if full.exists():
        if kind == "file" and not full.is_file():
            return [Finding(key, f"{value} is a folder, a file is expected")]
        if kind == "dir" and not full.is_dir():
            return [Finding(key, f"{value} is a file, a folder is expected")]
        return []
    if _is_produced(str(path), produced):
        return []
    return [Finding(key, f"{kind if kind != 'any' else 'path'} {value} does not exist ({full})")]


def check_weights(key: str, name: str, pretrained: str, root: Path, produced: list[str]) -> list[Finding]:
    """An open_clip model name + pretrained: "" (train from scratch), local-dir:<folder>, a checkpoint file, or a
    tag."""
    out: list[Finding] = []
    if pretrained.startswith("local-dir:"):
        folder = pretrained.split(":", 1)[1]
        if _is_produced(folder, produced):   # e.g. models/base: DVC deletes a stage's outputs before it runs
            return [Finding(key + ".pretrained", f"{folder} is a pipeline output (DVC removes it before its stage "
                                                 "runs): keep the weights elsewhere, e.g. datasets/weights/")]
        out += check_path(key + ".pretrained", folder, "dir", root, produced)
        full = Path(folder) if Path(folder).is_absolute() else root / folder
        if full.is_dir() and not (full / "open_clip_config.json").is_file():
            out.append(Finding(key + ".pretrained", f"{folder} has no open_clip_config.json (export_model layout)"))
        return out
    if name and (root / name).exists() or _is_produced(name, produced):  # an exported folder as the model name
        return check_path(key, name, "dir", root, produced)
    import open_clip

    from clipfinetune.models import loading

    known = set(open_clip.list_models())
    configs = Path(loading.__file__).parent / "configs"
    known |= {p.stem for p in configs.glob("*.json")}
    if name not in known:
        out.append(Finding(key,
                           f"open_clip model {name!r} is unknown (neither open_clip nor clipfinetune/models/configs)"))
    if not pretrained:
        return out
    if any(pretrained.endswith(s) for s in FILE_SUFFIXES) or "/" in pretrained:
        return out + check_path(key + ".pretrained", pretrained, "file", root, produced)
    tags = open_clip.list_pretrained_tags_by_model(name) if name in open_clip.list_models() else []
    if pretrained not in tags:
        return out + [Finding(key + ".pretrained", f"{pretrained!r} is not an open_clip tag of {name} ({tags})")]
    if not _weights_cached(name, pretrained):
        out.append(Finding(key + ".pretrained", f"{name}/{pretrained} not in the local cache yet: downloaded on "
                                                "first use (needs network)", missing=False))
    return out


def check_lism_model(name: str, pretrained: str, root: Path, produced: list[str]) -> list[Finding]:
    """Stage lism depends on `lism.model` as a path (dvc.yaml `${lism.model}`): a folder (an export, or a stage's
    output such as models/base); an open_clip name would make `dvc repro` fail on a missing dependency."""
    if not name:
        return [Finding("lism.model", "empty: the LISM matcher's exported folder is expected")]
    if (root / name).is_dir() or _is_produced(name, produced):
        return check_weights("lism.model", name, pretrained, root, produced)
    if (root / name).exists() or "/" in name:
        return check_path("lism.model", name, "dir", root, produced)
    folder = f"datasets/weights/{name}-{pretrained}" if pretrained else f"datasets/weights/{name}"
    return [Finding("lism.model", f"{name!r} is not a folder, but stage lism depends on lism.model as a path; "
                                  "export the weights once and name the folder: python -c \"from clipfinetune.models "
                                  "import export_model, load_model; "
                                  f"export_model(load_model({name!r}, {pretrained!r}), "
                                  f"{folder!r})\" (then lism.model: {folder}, lism.pretrained: \"\")")]


def _weights_cached(name: str, tag: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
        from open_clip.pretrained import get_pretrained_cfg

        cfg = get_pretrained_cfg(name, tag)
        hub = cfg.get("hf_hub", "")
        if hub:
            repo_id = "/".join(hub.rstrip("/").split("/")[:2])
            for fname in ("open_clip_model.safetensors", "open_clip_pytorch_model.bin"):
                if isinstance(try_to_load_from_cache(repo_id, fname), str):
                    return True
        url = cfg.get("url", "")
        if url:
            cache = Path.home() / ".cache" / "clip" / url.rsplit("/", 1)[-1]
            return cache.is_file()
    except Exception:  # noqa: BLE001  an unknown cache layout only costs a note
        return False
    return False


def check_endpoint(base_url: str, model: str, timeout: float) -> list[Finding]:
    url = base_url.rstrip("/") + "/models"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read().decode() or "{}")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return [Finding("negatives.base_url", f"GET {url} failed ({getattr(e, 'reason', e)}): is the vLLM server "
                                              f"running? (`vllm serve {model} --generation-config vllm`)")]
    served = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)]
    if model not in served:
        return [Finding("negatives.model", f"{model!r} is not served at {url} (serving: {served})")]
    return []


def _evalset_paths(task: str, name: str, cfg, prefix: str):
    """(key, value, kind) for every path-valued leaf of one benchmark set."""
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            yield from _evalset_paths(task, name, v, f"{prefix}.{k}")
        return
    if not isinstance(cfg, str) or not cfg:
        return
    leaf = prefix.rsplit(".", 1)[-1]
    kind = "dir" if leaf in DIR_KEYS or prefix.split(".")[-2] == "images" else \
        "file" if cfg.endswith(FILE_SUFFIXES) else "any"
    yield prefix, cfg, kind


def _runs_stage(params: dict):
    """Does dvc.yaml run this data stage under `params`? (`foreach: ${<stage>.sources}`: [] leaves it out.)"""
    return lambda stage: bool(_get(params, f"{stage}.sources"))


def check(params: dict, root=".", timeout: float = 5.0, produced: list[str] | None = None,
          leakage_check: bool = True, asks_llm: bool = True) -> list[Finding]:
    """Every finding of `params` under `root`. `asks_llm` False: the negatives stage will not run (its table is up
    to date), so its LLM endpoint or vLLM package is not checked."""
    root = Path(root)
    produced = produced_paths(root) if produced is None else produced
    found: list[Finding] = []
    found += check_weights("model", str(_get(params, "model.name") or ""), str(_get(params, "model.pretrained") or ""),
                           root, produced)
    runs = _runs_stage(params)
    if runs("lism"):
        found += check_lism_model(str(_get(params, "lism.model") or ""), str(_get(params, "lism.pretrained") or ""),
                                  root, produced)
    for key, kind in (PATH_PARAMS if runs("lism") else []) + source_path_params(params):
        found += check_path(key, _get(params, key), kind, root, produced)

    sam = _get(params, "segments.sam_checkpoint") if runs("segments") else None
    if sam:
        found += check_path("segments.sam_checkpoint", sam, "file", root, produced)
        if importlib.util.find_spec("segment_anything") is None:
            found.append(Finding("segments.sam_checkpoint", "package segment_anything is not installed "
                                 "(pip install git+https://github.com/facebookresearch/segment-anything)"))
    elif runs("segments"):
        found.append(Finding("segments.sam_checkpoint", "empty: the CPU segmenter (scikit-image) is used", False))

    backend = _get(params, "negatives.backend") if runs("negatives") and asks_llm else "rules"
    if backend == "server":
        found += check_endpoint(str(_get(params, "negatives.base_url")), str(_get(params, "negatives.model")), timeout)
    elif backend == "offline" and importlib.util.find_spec("vllm") is None:
        found.append(Finding("negatives.backend", "offline needs the vllm package (pip install vllm)"))
    elif backend not in ("rules", "server", "offline"):
        found.append(Finding("negatives.backend", f"{backend!r} is not one of rules|server|offline"))

    evalsets = _get(params, "eval.evalsets") or {}
    sets = set()
    for task, by_set in evalsets.items():
        for name, cfg in (by_set or {}).items():
            sets.add(name)
            for key, value, kind in _evalset_paths(task, name, cfg, f"eval.evalsets.{task}.{name}"):
                found += check_path(key, value, kind, root, produced)
    report_set = _get(params, "eval.report.set")
    if report_set and report_set not in sets:
        found.append(Finding("eval.report.set", f"{report_set!r} names no configured benchmark set ({sorted(sets)})"))
    if leakage_check:
        found += check_leakage(params, root, produced)
    return found


def training_images(params: dict, unchecked: list | None = None) -> list:
    """The images the shards stage trains on: the records of `shards.sources` in `shards.splits`
    (`leakage.training_images`); sources whose images are not files are named in `unchecked`."""
    from clipfinetune import leakage

    defined = _get(params, "sources") or {}
    names = _get(params, "shards.sources") or []
    missing = [n for n in names if n not in defined]
    if missing:
        raise ValueError(f"shards.sources {missing} are not defined under `sources`")
    return leakage.training_images({n: defined[n] for n in names}, _get(params, "shards.splits"), unchecked)


def check_leakage(params: dict, root: Path, produced: list[str]) -> list[Finding]:
    """Training images that a configured evaluation set scores (clipfinetune.leakage); digests cached under
    <root>/data/cache/leakage. A set whose files are missing is reported above and not compared."""
    import contextlib

    from clipfinetune import leakage
    from clipfinetune.digests import DIGEST_CACHE
    from clipfinetune.io import InputError

    found, unchecked = [], []
    with contextlib.chdir(root):        # params paths are relative to the project root
        try:
            train = training_images(params, unchecked)
        except (InputError, OSError, KeyError, ValueError) as e:
            return [Finding("leakage", f"training images not readable, leakage not checked: {e}")]
        if unchecked:
            found.append(Finding("leakage", f"sources {unchecked} hold their images in tables or tars: not compared "
                                            "with the evaluation sets", missing=False))
        unreadable: dict = {}
        evals = leakage.evaluation_sets(_get(params, "eval.evalsets"), unreadable)
        for where, error in unreadable.items():
            task, name = where.split(".", 1)
            cfg = (_get(params, "eval.evalsets") or {})[task][name]
            if not any(_is_produced(str(v), produced) for _, v, _ in _evalset_paths(task, name, cfg, "") if v):
                found.append(Finding(f"eval.evalsets.{where}", f"not compared with the training images: {error}",
                                     missing=False))   # its missing files are named above
        overlaps, cost = leakage.find_overlaps(train, evals, cache_dir=DIGEST_CACHE)
    for o in overlaps:
        found.append(Finding(f"eval.evalsets.{o.eval_set}", f"LEAKAGE {o}"))
    found.append(Finding("leakage", f"{cost['train_images']} training images compared with {cost['eval_images']} "
                                    f"images of {len(evals)} evaluation sets: {len(overlaps)} overlapping; "
                                    f"{cost['files_hashed']} files hashed, {cost['digests_reused']} digests reused "
                                    "(data/cache/leakage)", missing=False))
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m clipfinetune.project.validate", description=__doc__.splitlines()[0])
    p.add_argument("--params", default="params.yaml")
    p.add_argument("--root", default=None,
                   help="project root paths are relative to (default: the params file's folder)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for the endpoint check")
    args = p.parse_args(argv)
    import yaml

    params_path = Path(args.params)
    if not params_path.is_file():
        print(f"MISSING  {params_path} does not exist")
        return 1
    try:
        params = respell(yaml.safe_load(params_path.read_text()) or {}, str(params_path))
    except BothSpellings as e:
        print(f"MISSING  {e}")
        return 1
    root = Path(args.root) if args.root else params_path.resolve().parent
    findings = check(params, root, args.timeout)
    for f in findings:
        print(f)
    missing = [f for f in findings if f.missing]
    print(f"{params_path}: {len(missing)} missing" + ("" if missing else " - ready to run"))
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
