"""The negatives stage (`backend: server`) against a local fake OpenAI-compatible server on 127.0.0.1 (the approach
of tests/test_negatives_llm.py, reused): malformed / empty / echoed / over-long replies are rejected and counted,
a slow or unreachable server is a bounded, clear error naming the URL, and a request left unanswered after its retries
fails the stage with the count (the re-run asks only the missing ones) unless `negatives.max_failures` allows it."""
from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from clipfinetune.data.negatives.degla.llm import EndpointError, build_prompt
from clipfinetune.data.negatives.degla.validators import TYPES

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_negatives_llm import BEHAVIOUR, GOOD, server  # noqa: F401  (the fake server fixture)

pytestmark = pytest.mark.faults

CAPTIONS = "data/sample/annotations/captions_train.json"
BAD = {mode: cap for cap, mode in BEHAVIOUR.items() if mode in ("badjson", "empty", "echo", "overlong")}
FILL = 2            # a caption left short of K valid negatives gets one more answer of two types (module docs)


def server_project(tiny_project, tmp_path, base_url, captions, timeout=0.6, retries=2, max_failures=0):
    proj = tiny_project.clone(tmp_path / "p", ["data/sample"])
    caps = json.loads((proj / CAPTIONS).read_text())
    caps["annotations"] = [{"id": i + 1, "image_id": 1 + i // 5, "caption": c} for i, c in enumerate(captions)]
    (proj / CAPTIONS).write_text(json.dumps(caps))
    proj.set_params(negatives={"backend": "server", "base_url": base_url, "model": "fake", "concurrency": 4,
                               "timeout": timeout, "max_retries": retries, "backoff": 0.01, "max_tokens": 64,
                               "max_failures": max_failures})
    return proj


def test_bad_llm_replies_are_rejected_and_counted(server, tiny_project, tmp_path, inprocess):  # noqa: F811
    base_url = server[0]
    proj = server_project(tiny_project, tmp_path, base_url, GOOD + list(BAD.values()))
    inprocess(proj, "negatives")
    meta = proj.meta("data/prepared/negatives.meta.json")
    asked = 5 + FILL                                  # five rewrite types, then the fill answers
    assert meta["rejects"]["malformed_json"] == asked
    assert meta["rejects"]["empty"] == asked
    assert meta["rejects"]["unchanged"] >= asked
    assert meta["rejects"]["over_long"] >= asked
    rows = pd.read_parquet(proj / "data/prepared/negatives.parquet")
    assert not rows.caption.isin(list(BAD.values())).any()          # no bad reply became a negative
    assert rows.caption.isin(GOOD).sum() > 0


def test_slow_server_fails_bounded_naming_the_url(server, tiny_project, tmp_path, inprocess):  # noqa: F811
    base_url, llm, _, _ = server
    slow = next(c for c, m in BEHAVIOUR.items() if m == "slow")

    def always_slow(prompt, key):                     # every attempt outlasts the client's timeout
        import time
        time.sleep(0.5)
        return 200, json.dumps({"rewritten": slow})

    llm.reply = always_slow
    proj = server_project(tiny_project, tmp_path, base_url, [slow], timeout=0.2, retries=1)
    with pytest.raises(EndpointError) as err:
        inprocess(proj, "negatives")
    assert base_url in str(err.value) and "timeout" in str(err.value)


def test_unreachable_server_names_the_url(tiny_project, tmp_path, inprocess):
    with socket.socket() as s:                        # a port on 127.0.0.1 nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}/v1"
    proj = server_project(tiny_project, tmp_path, base_url, GOOD[:1], timeout=0.3, retries=1)
    with pytest.raises(EndpointError) as err:
        inprocess(proj, "negatives")
    assert base_url in str(err.value)
    assert not (proj / "data/prepared/negatives.parquet").exists()


# two requests the server never answers: one it lets time out, one it always refuses with HTTP 500
HANGS, REFUSED = (GOOD[0], "reshuffle"), (GOOD[1], "swap_nouns")


def breaking(llm, timeout):
    """llm.reply made to leave HANGS and REFUSED unanswered, every attempt; everything else answered as before."""
    good = llm.reply

    def reply(prompt, key):
        if prompt == build_prompt(*HANGS):
            time.sleep(timeout * 3)                   # past the client's timeout: it gives up on this attempt
            return 200, None
        if prompt == build_prompt(*REFUSED):
            return 500, None
        return good(prompt, key)

    llm.reply = reply
    return good


def prompts(payloads) -> list[str]:
    return [body["messages"][-1]["content"] for body in payloads]


def test_unanswered_requests_fail_the_stage_and_a_rerun_asks_only_them(server, tiny_project, tmp_path,  # noqa: F811
                                                                       inprocess):
    base_url, llm, payloads, _ = server
    good = breaking(llm, timeout=0.3)
    proj = server_project(tiny_project, tmp_path, base_url, GOOD, timeout=0.3, retries=1)
    with pytest.raises(SystemExit) as err:
        inprocess(proj, "negatives")
    n_asked = len(GOOD) * len(TYPES)                  # every caption x rewrite type, before any fill answer
    assert f"2 of {n_asked} LLM requests got no answer" in str(err.value)
    assert "negatives.max_failures" in str(err.value)
    assert not (proj / "data/prepared/negatives.parquet").exists()
    first = prompts(payloads)
    assert first.count(build_prompt(*HANGS)) == first.count(build_prompt(*REFUSED)) == 2    # 1 try + 1 retry

    llm.reply = good                                  # the server recovers: the re-run asks only the two
    del payloads[:]
    inprocess(proj, "negatives")
    second = prompts(payloads)
    fill = {build_prompt(c, t, 1) for c in GOOD for t in ("replace_nouns", "replace_adjectives")}
    assert sorted(p for p in second if p not in fill) == sorted([build_prompt(*HANGS), build_prompt(*REFUSED)])
    meta = proj.meta("data/prepared/negatives.meta.json")
    assert meta["requests_failed"] == 0 and meta["requests_asked"] == len(second)

    rows = pd.read_parquet(proj / "data/prepared/negatives.parquet")
    assert ((rows.caption == HANGS[0]) & (rows.type == HANGS[1])).any()      # the gaps are filled
    assert ((rows.caption == REFUSED[0]) & (rows.type == REFUSED[1])).any() or \
        ((rows.caption == REFUSED[0]) & (rows.type == "swap_adjectives")).any()   # the swap slot takes either


def test_max_failures_allows_a_stated_number_of_gaps(server, tiny_project, tmp_path, inprocess):  # noqa: F811
    base_url, llm, _, _ = server
    breaking(llm, timeout=0.3)
    proj = server_project(tiny_project, tmp_path, base_url, GOOD, timeout=0.3, retries=0, max_failures=2)
    inprocess(proj, "negatives")
    meta = proj.meta("data/prepared/negatives.meta.json")
    assert meta["requests_failed"] == 2 and meta["rejects"]["request_failed"] == 2
    rows = pd.read_parquet(proj / "data/prepared/negatives.parquet")
    assert not ((rows.caption == HANGS[0]) & (rows.type == HANGS[1])).any()
    assert not ((rows.caption == REFUSED[0]) & (rows.type == REFUSED[1])).any()
