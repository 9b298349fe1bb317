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

TESTS = Path(__file__).resolve().parent
FAULTS = TESTS / "faults"
# Tests whose module/session fixture runs pipeline stages as subprocesses (minutes each): scheduled first.
HEAVY_MARKERS = ("dag", "faults")
HEAVY_DIRS = ("scale", "real", "real_vllm")
# pyproject.toml's `timeout` holds for every other test; these build a pipeline's outputs in their first test's setup
HEAVY_TIMEOUT = 3600


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
    """Each test gets its xdist group (`group_of`) and a timeout fit for it; under xdist the heavy groups come first
    (a stable sort: `make test` passes --no-loadscope-reorder, so xdist queues the groups in this order), so both
    workers start on them at once and the unit tests fill the gaps, instead of a several-minute group starting late
    on one worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group_of(item.nodeid, config.rootpath)))
        if item.get_closest_marker("timeout") is None and is_heavy(item):
            item.add_marker(pytest.mark.timeout(HEAVY_TIMEOUT))
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in HEAVY_MARKERS))


def is_heavy(item) -> bool:
    """A test whose module or session fixture runs pipeline stages (markers `dag`, `faults`), or one of the suites
    run by name (tests/scale, tests/real, tests/real_vllm: minutes each)."""
    path = Path(str(item.path))
    return any(item.get_closest_marker(m) for m in HEAVY_MARKERS) or \
        (path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in HEAVY_DIRS)


@pytest.hookimpl(optionalhook=True)   # only called when pytest-xdist is installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core this process may use, at most 2 (the groups' fixtures are built once per
    worker; a third worker on more cores would mostly wait for the two heavy groups)."""
    return max(1, min(2, len(os.sched_getaffinity(0))))
