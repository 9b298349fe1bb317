"""What every stage shares: its declared params, logging, and the run-by-hand switch.

A stage script puts this checkout's root first on sys.path (it runs as `python stages/<name>.py`, from dvc.yaml or
by hand) and imports `from stages._common import start`; tests import the same modules as `stages.<name>`.
Every stage starts `args, params, log = start(__doc__, "<stage>")` (the parsed command line, the declared params, a
logger), and ends with `params.check_all_read()`.

A stage sees only the params dvc.yaml declares for it (what `dvc.api.params_show(stages=[name])` gives, read here
from dvc.yaml and params.yaml as files: `stage_definition`), and `StageParams.check_all_read()` fails if a declared
key was never read, so dvc.yaml and the code cannot drift apart (a stale declaration would re-run a stage for
nothing).

The `compute` group (GPUs, ranks) is the exception: the hardware, not an experiment parameter, so no stage declares
it and this module reads it from params.yaml (`compute_settings`); `launch` starts a model stage's ranks by the rules
of `clipfinetune.compute`.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from clipfinetune.keys import lookup

# Before torch loads: idle OpenMP threads sleep instead of spinning. With loader workers or a second stage
# sharing 2 cores, spinning threads made a training step ~4x slower (measured, see benchmarks/).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]


class StageParams:
    def __init__(self, stage: str, values: dict):
        self.stage, self._values, self._read = stage, values, set()
        self._declared = set(_flatten(values))

    def __getitem__(self, key: str):
        try:
            node = lookup(self._values, key)
        except KeyError:
            raise KeyError(f"stage {self.stage}: param '{key}' is not declared for it in dvc.yaml") from None
        self._read.update(k for k in self._declared if k == key or k.startswith(key + "."))
        return node

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def check_all_read(self) -> None:
        unread = sorted(self._declared - self._read)
        if unread:
            raise RuntimeError(f"stage {self.stage}: declared params never read (remove from dvc.yaml): {unread}")


def _flatten(d: dict, prefix: str = ""):
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _flatten(v, key + ".")
        else:
            yield key


def read_yaml(path: Path):
    """A YAML file as DVC reads it (ruamel's safe loader, YAML 1.2: `1e-4` is a number, `no` a string)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe").load(path.read_text())


class StageDefinitionError(SystemExit):
    """dvc.yaml names no such stage, or a stage reads a `${...}` or a param key that is not defined."""


_REFERENCE = re.compile(r"\$\{\s*([^}]*?)\s*\}")


def _interpolate(value, context: dict, where: str):
    """DVC's `${a.b}` in strings, keys, lists and mappings: a string that is one reference keeps the value's type."""
    if isinstance(value, dict):
        return {_interpolate(k, context, where): _interpolate(v, context, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, context, where) for v in value]
    if not isinstance(value, str):
        return value

    def resolve(name: str):
        try:
            return lookup(context, name)
        except KeyError:
            raise StageDefinitionError(f"dvc.yaml: {where}: ${{{name}}} is not defined (params.yaml or vars)") from None

    if (whole := _REFERENCE.fullmatch(value)) is not None:
        return resolve(whole.group(1))
    return _REFERENCE.sub(lambda m: _as_text(resolve(m.group(1))), value)


def _as_text(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)      # YAML's true/false, as DVC writes them


def _with_vars(context: dict, entries, root: Path, where: str) -> dict:
    """`vars:` entries (mappings, or YAML files beside dvc.yaml) over `context`."""
    for entry in entries or []:
        values = entry if isinstance(entry, dict) else read_yaml(root / str(entry))
        context = {**context, **_interpolate(values, context, where)}
    return context


def stage_definition(stage: str, root: Path | None = None) -> dict:
    """The body of `stage` as `dvc repro` expands dvc.yaml, read as files: params.yaml and dvc.yaml's `vars` are the
    values of `${...}`; `foreach` over a list names each stage `<group>@<item>` (its index when the items are not
    scalars) and over a mapping `<group>@<key>` with `${key}` and `${item...}`; a stage's own `vars` come last.
    dvc.lock is never read and nothing of DVC's is imported: DVC's own loading took about a second a stage (more once
    dvc.lock lists every stage). tests/test_params_declared.py compares every stage with DVC's own expansion."""
    root = root or ROOT
    dvc_yaml = read_yaml(root / "dvc.yaml") or {}
    params_file = root / "params.yaml"
    context = _with_vars(read_yaml(params_file) if params_file.is_file() else {}, dvc_yaml.get("vars"), root,
                         "vars")
    group, _, key = stage.partition("@")
    body = (dvc_yaml.get("stages") or {}).get(group)
    if body is None:
        raise StageDefinitionError(f"dvc.yaml has no stage {group!r} (asked for {stage!r})")
    if "matrix" in body:
        raise StageDefinitionError(f"dvc.yaml: stage {group}: `matrix` is not supported by stages/_common.py")
    if "foreach" not in body:
        if key:
            raise StageDefinitionError(f"dvc.yaml: stage {group} has no foreach, so no {stage!r}")
        context = _with_vars(context, body.get("vars"), root, stage)
        return _interpolate({k: v for k, v in body.items() if k != "vars"}, context, stage)
    items = _interpolate(body["foreach"], context, group)
    if isinstance(items, dict):
        entries = [(str(name), item) for name, item in items.items()]
    else:
        scalars = all(isinstance(item, (str, int, float, bool)) for item in items or [])
        entries = [(_as_text(item) if scalars else str(i), item) for i, item in enumerate(items or [])]
    for name, item in entries:
        if name == key:
            body_vars = body["do"].get("vars")
            context = _with_vars({**context, "item": item, "key": name}, body_vars, root, stage)
            return _interpolate({k: v for k, v in body["do"].items() if k != "vars"}, context, stage)
    raise StageDefinitionError(f"dvc.yaml: stage {group}'s foreach has no entry {key!r} (asked for {stage!r})")


def declared_keys(definition: dict, root: Path | None = None) -> list[tuple[str, str]]:
    """(params file, key) of each param a stage definition declares: `- a.b` is params.yaml's `a.b`,
    `- other.yaml: [keys]` another file's, `- other.yaml:` (no keys) every top-level key of that file."""
    out = []
    for entry in definition.get("params") or []:
        for file, keys in (entry.items() if isinstance(entry, dict) else [("params.yaml", [entry])]):
            if keys is None:
                keys = list(read_yaml((root or ROOT) / file) or {})
            out.extend((file, str(k)) for k in keys)
    return out


def declared_params(definition: dict, root: Path | None = None) -> dict:
    """The values of the params a stage definition declares, nested as `dvc.api.params_show(stages=[...])` gives
    them (a missing key fails naming it and its file)."""
    out: dict = {}
    files: dict[str, dict] = {}
    for file, key in declared_keys(definition, root):
        if file not in files:
            files[file] = read_yaml((root or ROOT) / file) or {}
        try:
            value = lookup(files[file], key)
        except KeyError:
            raise StageDefinitionError(f"dvc.yaml declares param {key!r}, which {file} lacks") from None
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def stage_params(stage: str | None = None) -> StageParams:
    stage = stage or os.environ.get("DVC_STAGE")
    if not stage:
        raise SystemExit("run through `dvc repro`, or pass --stage NAME (e.g. --stage train@clip)")
    definition = stage_definition(stage)
    try:
        return StageParams(stage, declared_params(definition))
    except StageDefinitionError as e:
        raise StageDefinitionError(f"stage {stage}: {e}") from None


def stage_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stage", default=None, help="stage name when run outside dvc (default: $DVC_STAGE)")
    return p


def setup_logging(stage: str) -> logging.Logger:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{stage}] %(message)s", datefmt="%H:%M:%S")
    return logging.getLogger(stage)


def stage_inputs(stage: str) -> dict[str, str]:
    """The stage's dvc.yaml deps (code and data) -> a digest of their content (a file's BLAKE2b; a folder's over its
    files' names and digests, `__pycache__` left out; "missing"), for the checkpoint fingerprint. The project's digest
    cache (clipfinetune.digests, keyed by path, size and mtime) keeps a big input from being read twice, and a checkout
    that rewrites an unchanged file changes nothing; the ranks of a node take turns (a lock file beside the cache), so
    the first hashes what is new and the others find it cached. params.yaml is covered by the declared params."""
    import fcntl
    import hashlib

    from clipfinetune.digests import DIGEST_CACHE, DigestCache

    deps = [rel for dep in stage_definition(stage).get("deps") or []
            for rel in (dep if isinstance(dep, dict) else [dep]) if rel != "params.yaml"]
    cache_dir = ROOT / DIGEST_CACHE
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    with open(cache_dir / "digests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = DigestCache(cache_dir)
        try:
            for rel in deps:
                path = ROOT / rel
                if path.is_file():
                    out[rel] = cache.digest(str(path), path.stat())
                elif path.is_dir():
                    h = hashlib.blake2b()
                    for f in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
                        h.update(f"{f.relative_to(path).as_posix()}\0{cache.digest(str(f), f.stat())}\n".encode())
                    out[rel] = h.hexdigest()
                else:
                    out[rel] = "missing"
        finally:
            cache.close()
    return out


def start(doc: str, default_stage=None, add_arguments=None, ranks=None):
    """Parse `--stage` (plus the stage's own arguments, added by `add_arguments(parser)`), load the params dvc.yaml
    declares for the stage, set up logging and, for a model stage, start its ranks (`launch`). The stage name:
    --stage, else $DVC_STAGE, else `default_stage` (a string, or for a `foreach` stage a function of the parsed
    arguments, e.g. `lambda a: f"eval@{a.model}"`). `ranks`: None = one process (a data stage); ITEMS = an item
    stage (every GPU); or a function (args, params) -> TrainingBatch | None for a training stage (None: one process,
    e.g. pretrain with real weights)."""
    parser = stage_parser((doc or "").strip().splitlines()[0] if doc else "")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    default = default_stage(args) if callable(default_stage) else default_stage
    params = stage_params(args.stage or os.environ.get("DVC_STAGE") or default)
    log = setup_logging(params.stage)
    if ranks is not None:
        launch(params, ranks if ranks == ITEMS else ranks(args, params), log)
    return args, params, log


def start_preparing(doc: str, stage: str, ranks=None):
    """`start` for a data stage that prepares one source's table: dvc.yaml runs it once per entry of its params
    `<stage>.sources` (`foreach`, stage `<stage>@<source>`), so `[]` leaves it out of the DAG when no run of the
    configuration reads its table. Returns (the source's name, params, logger)."""
    args, params, log = start(doc, lambda a: f"{stage}@{a.source}", lambda p: p.add_argument(
        "--source", help=f"the source this run of `{stage}` prepares (one entry of {stage}.sources)"), ranks)
    listed = list(params[f"{stage}.sources"])
    if len(listed) != 1 or args.source not in (None, listed[0]):
        raise SystemExit(f"stage {params.stage}: {stage}.sources is {listed}: the stage writes one table, so it "
                         f"prepares one source; list exactly one, or [] to leave the stage out")
    return listed[0], params, log


# --------------------------------------------------------------------------------------------- compute and ranks
ITEMS = "items"        # `start(..., ranks=ITEMS)`: an item stage (segments, lism, eval): every GPU, any count


@dataclass(frozen=True)
class TrainingBatch:
    """What a training stage tells the launcher: its global batch, micro-batches per rank, and the param that sets
    the batch (named in the error when it does not split)."""
    global_batch: int
    accum_steps: int = 1
    param: str = "train.batch_size"


def params_yaml() -> dict:
    """params.yaml as a whole, for what no stage declares: the hardware (`compute`), and the name of a param an error
    points at."""
    import yaml

    return yaml.safe_load((ROOT / "params.yaml").read_text()) or {}


def compute_settings() -> dict:
    """params.yaml's `compute` group, checked (clipfinetune.compute): the hardware, read here from the file and
    declared by no stage in dvc.yaml, so that a change of GPUs or ranks re-runs nothing (what a stage computes does
    not depend on it: docs/scale.md)."""
    from clipfinetune import compute

    values = params_yaml().get("compute")
    try:
        return compute.settings(values)
    except compute.ComputeError as e:
        raise SystemExit(f"params.yaml: {e}") from e


def compute_device() -> str:
    """`compute.device` (auto | cpu | cuda) for `clipfinetune.distributed.init_distributed`."""
    return compute_settings()["device"]


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (indices when it is unset); [] without CUDA."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return (named or [str(i) for i in range(count)])[:count]


# set by torchrun (RANK, WORLD_SIZE) or SLURM's srun (SLURM_PROCID): the process is one rank already
def launched_as_rank() -> bool:
    """Is this process already one rank of several? torchrun sets RANK/WORLD_SIZE; srun sets SLURM_NTASKS > 1. (A
    plain sbatch script also carries SLURM_PROCID, with one task: a `dvc repro` there must still launch its ranks.)"""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def stage_ranks(stage: str, request, compute: dict, visible: list[str]) -> tuple[int, list[str], int]:
    """(ranks, the GPUs they take) of a stage on this node (clipfinetune.compute's rules): an item stage every GPU
    the ranks may use (`compute.nproc`), a training stage the largest count that splits its global batch
    (`compute.train_nproc`), a data stage one process; and how many GPUs the ranks could have used. A setting that
    cannot run exits naming the values that can."""
    from clipfinetune import compute as rules

    if request is None:
        return 1, [], 0
    cuda = rules.uses_cuda(compute, len(visible))
    try:
        gpus = rules.rank_gpus(compute, visible) if cuda else []
        most = rules.item_ranks(compute, len(gpus), cuda)
        n = most if request == ITEMS else rules.training_ranks(compute, request.global_batch, most,
                                                               accum_steps=request.accum_steps, param=request.param)
    except rules.ComputeError as e:
        raise SystemExit(f"stage {stage}: {e}. Values that work: {', '.join(e.fixes) or 'none'}") from e
    return n, gpus[:n], len(gpus)


_HELD = contextlib.ExitStack()       # a one-process GPU stage's card lock, held until the process exits


def hold_gpus(gpus: list[str], log) -> None:
    """Lock these GPUs until this process exits (`compute.gpu_locks`), waiting for a stage of a concurrent
    experiment that holds one: a one-process GPU stage (or vLLM's offline engine in `negatives`)."""
    from clipfinetune.compute import gpu_locks

    _HELD.enter_context(gpu_locks(gpus, on_wait=lambda gpu: log.info(
        "waiting for GPU %s: another stage holds it (a queued experiment beside this one)", gpu)))


def launch(params: StageParams, request, log) -> None:
    """Run this stage as its ranks (`stage_ranks`): one process stays as it is; N > 1 re-runs the stage through
    PyTorch's launcher (torch.distributed.run, standalone rendezvous on this node) with CUDA_VISIBLE_DEVICES set to
    its GPUs, exiting with its exit code. The GPUs are locked while the stage runs (`compute.gpu_locks`: concurrent
    queue jobs on one host wait for each other's cards). Under torchrun or srun already, the process joins as it is."""
    if launched_as_rank():
        return
    from clipfinetune.compute import gpu_locks

    nproc, gpus, usable = stage_ranks(params.stage, request, compute_settings(), visible_gpus())
    if request not in (None, ITEMS) and gpus and len(gpus) < usable:
        log.info("%d rank(s) on GPU(s) %s: %s %d splits evenly over no more of them (clipfinetune plan names the "
                 "batch sizes that use every GPU)", nproc, ",".join(gpus), request.param, request.global_batch)
    if nproc <= 1:
        hold_gpus(gpus, log)
        return
    locks = gpu_locks(gpus, on_wait=lambda gpu: log.info("waiting for GPU %s: another stage holds it (a queued "
                                                         "experiment beside this one)", gpu))
    import subprocess

    # "--" ends the launcher's options: its parser would take a stage's `--run` for an abbreviated `--run-path`
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--",
           sys.argv[0], *sys.argv[1:]]
    env = {**os.environ, "DVC_STAGE": params.stage}     # the ranks resolve the same stage name
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    log.info("launching %d ranks%s", nproc, f" on GPU(s) {','.join(gpus)}" if gpus else " (gloo, CPU)")
    with locks:
        code = subprocess.call(cmd, env=env)
    raise SystemExit(code)


def source_specs(params: StageParams, names) -> dict[str, dict]:
    """{name: params `sources.<name>`} for the source names a stage lists (an unknown name fails naming it)."""
    names = [names] if isinstance(names, str) else list(names)
    defined = params["sources"]
    missing = [n for n in names if n not in defined]
    if missing:
        raise SystemExit(f"stage {params.stage}: sources {missing} are not defined under `sources` in params.yaml "
                         f"(defined: {sorted(defined)})")
    return {n: dict(defined[n]) for n in names}
