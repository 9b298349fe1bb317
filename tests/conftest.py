"""Test-wide settings, and the grouping of tests for pytest-xdist (`make test` runs `-n 2 --dist loadgroup`)."""
import os
from pathlib import Path

import pytest

# Before torch loads: idle OpenMP threads sleep instead of spinning (2 shared cores; see stages/_common.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The tests' host counts (clipfinetune/host.py: environment, not params; the stages' subprocesses inherit them): no
# training loader or eval workers and one eval thread, as other tests share the 2 cores; LISM's workers: the host's.
HOST_COUNTS = {"CLIPFINETUNE_WORKERS": "0", "CLIPFINETUNE_EVAL_WORKERS": "0", "CLIPFINETUNE_EVAL_THREADS": "1"}
for _name, _value in HOST_COUNTS.items():
    os.environ.setdefault(_name, _value)

FAULTS = Path(__file__).resolve().parent / "faults"
# Tests whose module/session fixture runs pipeline stages as subprocesses (minutes each): scheduled first.
HEAVY_MARKERS = ("dag", "faults")


def group_of(nodeid: str, rootpath: Path) -> str:
    """The xdist group of a test. tests/faults/* share the session fixture `tiny_project`: one group "faults".
    Any other test: a group per module file, so a module-scoped fixture (e.g. test_dag.py's `dvc repro`) is
    built once, as with `--dist loadfile`."""
    module = nodeid.split("::", 1)[0]
    try:
        faults = FAULTS.relative_to(rootpath).as_posix() + "/"
    except ValueError:
        faults = "tests/faults/"
    return "faults" if module.startswith(faults) else module


def pytest_configure(config):
    # pytest-xdist registers this mark itself; without xdist (plain `pytest tests`) the marks are inert
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup runs a group on one worker")


@pytest.hookimpl(tryfirst=True)       # before xdist's own hook turns the marks into `nodeid@group`
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid, config.rootpath)))
    if hasattr(config, "workerinput"):
        # Under xdist: the heavy groups first (stable sort), so both workers start on them at once and the unit
        # tests fill the gaps, instead of a several-minute group starting late on one worker.
        items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in HEAVY_MARKERS))


@pytest.hookimpl(optionalhook=True)   # only called when pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupScheduling(LoadGroupScheduling):
        """xdist's loadgroup, with two changes:
        - the groups are queued in collection order (heavy first, see above), not re-sorted by their number
          of tests (`--loadscope-reorder`), which would queue the few-test heavy groups behind the unit modules;
        - a test id without the `@group` suffix gets its group from `group_of`: with pytest >= 9.2 (structured
          node ids) xdist <= 3.8's suffix no longer takes effect and loadgroup silently stops grouping
          (pytest-xdist#1386), which would build the DAG and fault fixtures on both workers."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return super()._split_scope(nodeid)
            return group_of(nodeid, self.config.rootpath)

        def schedule(self) -> None:
            reorder = self.config.option.loadscopereorder
            self.config.option.loadscopereorder = False
            try:
                super().schedule()
            finally:
                self.config.option.loadscopereorder = reorder

    return GroupScheduling(config, log)
