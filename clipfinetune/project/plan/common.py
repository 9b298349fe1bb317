"""The plan's shared vocabulary: refusals, stage rows, the hardware, params lookups, what a run's method asks for."""
from __future__ import annotations

from dataclasses import dataclass, field

from clipfinetune.keys import lookup

LONG_READERS = {"docci", "dci", "urban1k", "sharegpt4v"}


STAGE_SOURCE_KIND = {"word_regions": "short", "negatives": "short", "sentences": "long", "segments": "long",
                     "lism": "long"}


# what reads a data stage's table besides the training runs: lism reads sentences and segments
DOWNSTREAM = {"sentences": ["lism"], "segments": ["lism"]}


LOCAL_HOSTS = {"127.0.0.1", "localhost", "0.0.0.0", "::1", ""}


ITEM_SCRIPTS = {"stages/segments.py", "stages/lism.py", "stages/eval.py"}


MINOR = {"sample", "code", "evalsets", "report"}     # seconds to minutes at any size: left out of the summary


@dataclass
class Refusal:
    stage: str            # "" = the configuration as a whole
    param: str            # the key to change
    message: str
    fixes: list[str] = field(default_factory=list)

    def __str__(self):
        where = f"[{self.stage}] " if self.stage else ""
        fixes = f" Values that work: {'; '.join(self.fixes)}" if self.fixes else ""
        return f"{where}{self.param}: {self.message}.{fixes}"


@dataclass
class StageRow:
    stage: str
    kind: str                         # data | items | training | export
    device: str = "cpu"
    ranks: int = 1
    gpus: list[str] = field(default_factory=list)
    global_batch: int | None = None
    rank_batch: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    units: int | None = None          # per epoch
    seen: int | None = None
    repeated: int | None = None
    coverage: str = ""                # exact | estimated | unknown | ""
    items: int | None = None          # what an item or data stage processes (images, captions)
    items_what: str = ""
    inputs_bytes: int | None = None
    outputs_bytes: int | None = None
    outputs_note: str = ""
    llm_requests: int | None = None
    seconds: float | None = None
    basis: str = "unknown"            # measured | scaled | unknown (the time's)
    time_source: str = "unknown"      # from what, by what rule
    gpu_seconds: float | None = None  # seconds x the GPUs it holds
    paper: str = ""                   # the paper's own stated cost of such a run, where it gives one
    method: str = ""                  # a training stage's method (its step rate)
    latency_bound: bool = False       # per-rank batch under ~32: more GPUs do not make its steps faster
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------- the plan
@dataclass
class Hardware:
    gpus: int                 # per node
    nodes: int
    gpu_kind: str             # e.g. "NVIDIA H200"; "cpu" without GPUs


# ------------------------------------------------------------------------------------------------ helpers
def _get(params: dict, key: str, default=None):
    return lookup(params, key, default)


def _has(params: dict, key: str) -> bool:
    sentinel = object()
    return _get(params, key, sentinel) is not sentinel


def _kind_of_source(params: dict, name: str) -> str:
    reader = (_get(params, f"sources.{name}") or {}).get("reader", "")
    return "long" if reader in LONG_READERS else "short"


def _sources_of_kind(params: dict, kind: str) -> list[str]:
    return [n for n in _get(params, "shards.sources") or [] if _kind_of_source(params, n) == kind]


def _method(run: dict):
    """The run's method as configured (what the planner needs to know about it, it asks the method's hooks:
    `prepared_tables`, `caption_kinds`, `units_table`, `epoch_unit`); None if it does not construct, which the
    train stage would stop on too (`resolve_runs` refuses unknown methods and keys first)."""
    from clipfinetune.methods import get_method

    try:
        return get_method(run["method"])(**run["config"])
    except Exception:  # noqa: BLE001  the run's own error is the train stage's
        return None


def _tables_needed(run: dict) -> list[tuple[str, str]]:
    method = _method(run)
    return method.prepared_tables() if method is not None else []


def _producing(stages: list, base: str) -> list[str]:
    return [s.name for s in stages if s.name.split("@", 1)[0] == base]


def _fmt_seconds(s: float | None) -> str:
    if s is None:
        return "unknown"
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _fmt_int(n) -> str:
    return "-" if n is None else f"{n:,}"
