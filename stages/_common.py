"""What every stage shares: its declared params, logging, and the run-by-hand switch.

Every stage starts the same way: `import _common` (puts the repo on sys.path), then
`args, params, log = start(__doc__, "<stage>")` (the parsed command line, the declared params, a logger), and
ends with `params.check_all_read()`.

A stage sees only the params dvc.yaml declares for it (`dvc.api.params_show(stages=[name])`), and
`StageParams.check_all_read()` fails if a declared key was never read, so dvc.yaml and the code cannot
drift apart (a stale declaration would re-run a stage for nothing).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

# Before torch loads: idle OpenMP threads sleep instead of spinning. With loader workers or a second stage
# sharing 2 cores, spinning threads made a training step ~4x slower (measured, see benchmarks/).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clipfinetune.keys import lookup


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


@contextlib.contextmanager
def lockfile_skipped():
    """What a stage declares comes from dvc.yaml alone; DVC would also parse dvc.lock (ruamel, ~1 s per load once
    the 34 stages are locked, twice per params_show), which a stage never needs."""
    from dvc.dvcfile import ProjectFile

    original = ProjectFile.__dict__["lockfile_contents"]
    ProjectFile.lockfile_contents = property(lambda self: {})
    try:
        yield
    finally:
        ProjectFile.lockfile_contents = original


def stage_params(stage: str | None = None) -> StageParams:
    import dvc.api

    stage = stage or os.environ.get("DVC_STAGE")
    if not stage:
        raise SystemExit("run through `dvc repro`, or pass --stage NAME (e.g. --stage train@clip)")
    with lockfile_skipped():
        return StageParams(stage, dvc.api.params_show(stages=[stage], repo=str(ROOT)))


def stage_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stage", default=None, help="stage name when run outside dvc (default: $DVC_STAGE)")
    return p


def setup_logging(stage: str) -> logging.Logger:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s [{stage}] %(message)s", datefmt="%H:%M:%S")
    return logging.getLogger(stage)


def stage_inputs(stage: str) -> dict[str, str]:
    """The stage's dvc.yaml deps (code and data) -> their content hash as DVC computes it (md5; a folder's .dir
    md5; "missing"), for the checkpoint fingerprint. DVC's state cache keeps a big input from being re-read.
    params.yaml is covered by the declared params themselves."""
    from dvc.repo import Repo

    out = {}
    with lockfile_skipped(), Repo(str(ROOT)) as repo:
        (info,) = repo.stage.collect_granular(stage)
        for dep in info.stage.deps:
            if dep.def_path != "params.yaml":
                out[dep.def_path] = dep.get_hash().value if dep.exists else "missing"
    return out


def start(doc: str, default_stage=None, add_arguments=None):
    """Parse `--stage` (plus the stage's own arguments, added by `add_arguments(parser)`), load the params dvc.yaml
    declares for the stage and set up logging. The stage name: --stage, else $DVC_STAGE, else `default_stage`
    (a string, or for a `foreach` stage a function of the parsed arguments, e.g. `lambda a: f"eval@{a.model}"`)."""
    parser = stage_parser((doc or "").strip().splitlines()[0] if doc else "")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args()
    default = default_stage(args) if callable(default_stage) else default_stage
    params = stage_params(args.stage or os.environ.get("DVC_STAGE") or default)
    relaunch_as_ranks(params)
    return args, params, setup_logging(params.stage)


def start_preparing(doc: str, stage: str):
    """`start` for a data stage that prepares one source's table: dvc.yaml runs it once per entry of its params
    `<stage>.sources` (`foreach`, stage `<stage>@<source>`), so `[]` leaves it out of the DAG when no run of the
    configuration reads its table. Returns (the source's name, params, logger)."""
    args, params, log = start(doc, lambda a: f"{stage}@{a.source}", lambda p: p.add_argument(
        "--source", help=f"the source this run of `{stage}` prepares (one entry of {stage}.sources)"))
    listed = list(params[f"{stage}.sources"])
    if len(listed) != 1 or args.source not in (None, listed[0]):
        raise SystemExit(f"stage {params.stage}: {stage}.sources is {listed}: the stage writes one table, so it "
                         f"prepares one source; list exactly one, or [] to leave the stage out")
    return listed[0], params, log


# set by torchrun (RANK, WORLD_SIZE) or SLURM's srun (SLURM_PROCID): the process is one rank already
def launched_as_rank() -> bool:
    """Is this process already one rank of several? torchrun sets RANK/WORLD_SIZE; srun sets SLURM_NTASKS > 1. (A
    plain sbatch script also carries SLURM_PROCID, with one task: a `dvc repro` there must still launch its ranks.)"""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def stage_ranks(params: StageParams) -> int:
    """Ranks a model stage runs as, from `compute.nproc` (auto = every visible GPU when the stage uses CUDA, 1 on
    the CPU; an integer N = N ranks, gloo ranks on the CPU). 1 for a stage that does not declare it."""
    setting = params.get("compute.nproc", 1)
    if setting == "auto":
        import torch

        uses_cuda = params.get("compute.device", "auto") != "cpu" and torch.cuda.is_available()
        return max(torch.cuda.device_count(), 1) if uses_cuda else 1
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise SystemExit(f"stage {params.stage}: compute.nproc must be auto or a positive integer, got {setting!r}")
    return setting


def relaunch_as_ranks(params: StageParams) -> None:
    """Re-run this stage as `stage_ranks` ranks through PyTorch's launcher (torch.distributed.run, standalone
    rendezvous on this node), exiting with its exit code; under torchrun or srun already, join as we are."""
    nproc = stage_ranks(params)
    if nproc <= 1 or launched_as_rank():
        return
    import subprocess

    # "--" ends the launcher's options: its parser would take a stage's `--run` for an abbreviated `--run-path`
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "--",
           sys.argv[0], *sys.argv[1:]]
    env = {**os.environ, "DVC_STAGE": params.stage}     # the ranks resolve the same stage name
    raise SystemExit(subprocess.call(cmd, env=env))


def source_specs(params: StageParams, names) -> dict[str, dict]:
    """{name: params `sources.<name>`} for the source names a stage lists (an unknown name fails naming it)."""
    names = [names] if isinstance(names, str) else list(names)
    defined = params["sources"]
    missing = [n for n in names if n not in defined]
    if missing:
        raise SystemExit(f"stage {params.stage}: sources {missing} are not defined under `sources` in params.yaml "
                         f"(defined: {sorted(defined)})")
    return {n: dict(defined[n]) for n in names}
