"""clipfinetune/host.py: worker and thread counts follow the host, not params. By default a rank gets the cores its
process may use divided by the ranks on the host (torchrun's LOCAL_WORLD_SIZE), at least 1 and at most CAP; an
environment variable sets a count per host; a value that is no count fails naming the variable. That a changed
count re-runs no stage: tests/test_dag.py; that no stage declares one: tests/test_params_declared.py."""
from __future__ import annotations

import pytest

from clipfinetune import host


@pytest.fixture
def bare(monkeypatch):
    """No count set in the environment (tests/conftest.py sets the tests' own) and one rank."""
    for name in host.VARIABLES.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return monkeypatch


@pytest.mark.parametrize(("cores", "ranks", "expected"), [(2, None, 2), (16, None, 12), (128, "8", 12),
                                                          (64, "8", 8), (16, "8", 2), (4, "8", 1)])
def test_a_count_defaults_to_the_hosts_cores_per_rank_capped(bare, cores, ranks, expected):
    bare.setattr(host, "cores", lambda: cores)
    if ranks:
        bare.setenv("LOCAL_WORLD_SIZE", ranks)
    assert {kind: host.count(kind) for kind in host.VARIABLES} == dict.fromkeys(host.VARIABLES, expected)


def test_the_environment_sets_each_count_per_host(bare):
    bare.setattr(host, "cores", lambda: 16)
    bare.setenv("CLIPFINETUNE_WORKERS", "6")
    bare.setenv("CLIPFINETUNE_EVAL_THREADS", "0")
    assert host.settings() == {"train": 6, "eval": 12, "eval_threads": 0, "lism": 12}


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_value_that_is_no_count_fails_naming_the_variable(bare, value):
    bare.setenv("CLIPFINETUNE_LISM_WORKERS", value)
    with pytest.raises(ValueError, match="CLIPFINETUNE_LISM_WORKERS"):
        host.count("lism")
