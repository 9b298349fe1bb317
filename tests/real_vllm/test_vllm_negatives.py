"""The `negatives` stage against a real vLLM on CPU (`make test-vllm`): a random tiny Llama
(tests/real_vllm/tiny_llama.py) served by vLLM's OpenAI-compatible server (`backend: server`), and run in-process by
`vllm.LLM` (`backend: offline`, the stage run with the vLLM venv's python), on the sample world's training captions.

A random model's rewrites are garbage, so the validators reject nearly all of them: what is checked is that every
answer is counted and none crashes the stage. The server is reached through a recording reverse proxy on 127.0.0.1,
so the tests see every request and every response. The stage sends a seed per request and vLLM honours it, so a
killed-and-resumed run must end with exactly the answers of an uninterrupted one.
All traffic goes to 127.0.0.1; every wait is bounded; the server is stopped at the end, also on failure.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pandas as pd
import pytest
from fixtures.project import copy_project, env, run, write_params

from clipfinetune.data.negatives.degla.llm import build_prompt

pytestmark = pytest.mark.vllm

VLLM_PYTHON = os.environ.get("VLLM_PYTHON", "")
TINY_LLAMA = Path(__file__).resolve().parent / "tiny_llama.py"
SERVED = "tiny-llama"
SAMPLE = {"n_train": 8, "n_val": 4, "n_docci_train": 6, "n_docci_test": 2, "n_compositional": 2,
          "n_zeroshot_per_class": 1, "n_pretrain": 0}                  # 40 training captions
MAX_TOKENS = 256
NEGATIVES = {"concurrency": 8, "timeout": 60, "max_retries": 2, "backoff": 0.2, "max_tokens": MAX_TOKENS,
             "temperature": 0.7, "seed": 0}
# vLLM: 1 GiB of KV cache on CPU; no usage statistics and no hub look-ups (no network but 127.0.0.1)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}
# The stage seeds every request; vLLM's CPU build dies on a seeded request after a chunked-prefill step ("CPU
# Generator does not use offset": it rewinds the generator with a CUDA-only call), so its server runs without it
# (the README says so). The token budget must then hold a whole prompt: at least --max-model-len.
# --enforce-eager skips torch.compile's warm-up (~50 s of a ~100 s start on 2 busy cores); the serving path is the same.
CPU_SERVER_FLAGS = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024", "--enforce-eager")
SERVER_START_S = 600        # a cold start on 2 busy cores took ~100 s
STAGE_S = 900
OUT = "data/prepared/negatives.parquet"
META = "data/prepared/negatives.meta.json"
RUN_STATISTICS = ("seconds", "requests_asked", "answers_from_cache", "cache_corrupt_lines")


# ------------------------------------------------------------------------------------------------ helpers
def make_project(dest: Path, **negatives) -> Path:
    """A copy of the project with the tiny sample world generated and `negatives` params overridden."""
    repo = copy_project(dest)
    write_params(repo, {"sample": SAMPLE, "negatives": {**NEGATIVES, **negatives}})
    run(repo, "git", "init", "-q")
    run(repo, sys.executable, "stages/sample.py", "--stage", "sample@world")
    return repo


def stage_cmd(python: str = sys.executable) -> list[str]:
    return [python, "stages/negatives.py", "--stage", "negatives@coco"]


def run_stage(repo: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    proc = subprocess.run(stage_cmd(python), cwd=repo, env={**env(), **VLLM_ENV}, capture_output=True, text=True,
                          timeout=STAGE_S, check=False)
    assert proc.returncode == 0, f"negatives failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def cache_records(repo: Path) -> list[dict]:
    """The parseable lines of the stage's answer cache (a killed writer may leave half a last line)."""
    out = []
    for path in sorted((repo / "data/cache/negatives").glob("*.jsonl")):
        for line in path.read_bytes().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def answers_by_request(records: list[dict]) -> dict:
    return {(r["caption"], r["type"], r["variant"]): (r["text"], r["error"], r["raw"]) for r in records}


def wait_for_cache(repo: Path, proc: subprocess.Popen, lines: int, deadline_s: float = 600) -> None:
    deadline = time.monotonic() + deadline_s
    while len(cache_records(repo)) < lines:
        assert proc.poll() is None, \
            f"the stage ended before {lines} answers were cached:\n{proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"fewer than {lines} answers cached after {deadline_s} s"
        time.sleep(0.1)


def meta_without_run_statistics(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in RUN_STATISTICS}


def strict_answer(content: str) -> bool:
    """Is the reply the JSON object asked for, by the JSON standard (no raw control characters in strings)?"""
    try:
        obj = json.loads(content)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("rewritten"), str)


def assert_counts_add_up(repo: Path, meta: dict, replies: list[str]) -> None:
    """Every reply of the run is one answer in the meta, either accepted or rejected with a reason."""
    annotations = json.loads((repo / "data/sample/annotations/captions_train.json").read_text())["annotations"]
    distinct = len({" ".join(a["caption"].split()) for a in annotations})
    rejects, valid = meta["rejects"], sum(meta["valid_per_type"].values())
    assert meta["captions"] == len(annotations) and meta["distinct_captions"] == distinct
    assert meta["requests_failed"] == 0 and "request_failed" not in rejects
    assert meta["answers"] == len(replies) == meta["requests_asked"]
    # 5 rewrite types per caption, then 2 fill-ins for each caption left short of 4 valid negatives
    assert meta["answers"] == 5 * distinct + 2 * meta["fill_requests_for"]
    assert valid + sum(rejects.values()) == meta["answers"]
    assert rejects.get("malformed_json", 0) == sum(not strict_answer(c) for c in replies)
    assert meta["reject_rate"] == pytest.approx(100 * sum(rejects.values()) / meta["answers"], abs=1e-3)
    frame = pd.read_parquet(repo / OUT)
    assert len(frame) == meta["rows"] <= valid
    per_caption = frame.groupby(["image_id", "caption_index"]).size()
    assert (per_caption <= 4).all()
    assert meta["valid4_rate"] == pytest.approx(100 * (per_caption == 4).sum() / len(annotations), abs=1e-3)


# ------------------------------------------------------------------------------------------ vLLM server + proxy
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in its own process group on 127.0.0.1 (the `vllm` console
    script fails in the vllm-cpu distribution: importlib.metadata knows no "vllm")."""

    def __init__(self, model_dir: Path, log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                 "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(self.port),
                 "--max-model-len", "1024", "--dtype", "float32", *CPU_SERVER_FLAGS],
                env={**os.environ, **VLLM_ENV}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vLLM exited ({self.proc.returncode}):\n{self.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
                    if SERVED in r.read().decode():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError(f"vLLM not up after {SERVER_START_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the server's process group (API server + engine core), SIGKILL if it lingers."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            time.sleep(1)       # the engine core leaves with its parent; a SIGKILL round catches a straggler


class RecordingProxy:
    """A reverse proxy on 127.0.0.1 in front of the server: records every request body, status and response."""

    def __init__(self, upstream: str):
        self.exchanges: list[dict] = []
        self.in_flight = 0
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                with proxy.lock:
                    proxy.in_flight += 1
                try:
                    self.forward()
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def forward(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = urllib.request.Request(upstream + self.path, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, out = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, out = e.code, e.read()
                except (urllib.error.URLError, OSError) as e:
                    status, out = 502, str(e).encode()
                proxy.exchanges.append({"path": self.path, "request": json.loads(body), "status": status,
                                        "response": json.loads(out) if status == 200 else out.decode(errors="replace")})
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def settle(self, timeout_s: float = 120, quiet_s: float = 3.0) -> None:
        """Wait until no request is in flight and none has started or ended for `quiet_s` (a killed client's
        requests still complete here; one accepted but not yet in `do_POST` under load shows up only later)."""
        deadline = time.monotonic() + timeout_s
        seen, quiet_since = None, time.monotonic()
        while True:
            now_state = (self.in_flight, len(self.exchanges))
            if now_state != seen:
                seen, quiet_since = now_state, time.monotonic()
            elif not self.in_flight and time.monotonic() - quiet_since >= quiet_s:
                return
            assert time.monotonic() < deadline, f"{self.in_flight} requests still in flight after {timeout_s} s"
            time.sleep(0.05)

    def replies(self) -> list[str]:
        return [e["response"]["choices"][0]["message"]["content"] for e in self.exchanges]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    assert Path(VLLM_PYTHON).is_file(), f"$VLLM_PYTHON={VLLM_PYTHON!r}: run `make test-vllm` (it builds vLLM's venv)"
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def tiny_llama(workdir) -> Path:
    """The random Llama, its tokenizer trained on a sample world's captions."""
    captions = make_project(workdir / "captions") / "data/sample/annotations/captions_train.json"
    out = workdir / "tiny-llama"
    proc = subprocess.run([VLLM_PYTHON, str(TINY_LLAMA), "--captions", str(captions), "--out", str(out)],
                          env={**os.environ, **VLLM_ENV}, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def server(tiny_llama, workdir):
    vllm = VllmServer(tiny_llama, workdir / "vllm-server.log")
    proxy = None
    try:
        vllm.wait_ready()
        proxy = RecordingProxy(f"http://127.0.0.1:{vllm.port}")
        yield vllm, proxy
    finally:
        if proxy is not None:
            proxy.close()
        vllm.stop()


@pytest.fixture(scope="module")
def first_run(server, workdir) -> dict:
    """An uninterrupted `backend: server` run through the recording proxy: the reference of the other tests."""
    _, proxy = server
    repo = make_project(workdir / "reference", backend="server", base_url=proxy.url, model=SERVED)
    proxy.exchanges.clear()
    run_stage(repo)
    return {"repo": repo, "base_url": proxy.url, "exchanges": list(proxy.exchanges), "replies": proxy.replies(),
            "meta": json.loads((repo / META).read_text()), "frame": pd.read_parquet(repo / OUT),
            "answers": answers_by_request(cache_records(repo))}


# ---------------------------------------------------------------------------------------------------- tests
def test_offline_backend_runs_the_stage_in_vllms_venv(tiny_llama, workdir):
    """`backend: offline`: the stage itself runs with the vLLM venv's python (`vllm.LLM` in-process)."""
    repo = make_project(workdir / "offline", backend="offline", model=str(tiny_llama))
    run_stage(repo, VLLM_PYTHON)
    meta = json.loads((repo / META).read_text())
    records = cache_records(repo)
    assert meta["backend"] == "offline" and re.fullmatch(r"\d+\.\d+\.\d+.*", meta["vllm_version"])
    assert len(records) == meta["requests_asked"] and all(r["backend"] == "offline" for r in records)
    assert_counts_add_up(repo, meta, [r["raw"] for r in records])
    # structured output was on: a random model opens {"rewritten": " by chance with negligible probability
    assert all(re.match(r'\{\s*"rewritten"\s*:\s*"', r["raw"]) for r in records)

    frame = pd.read_parquet(repo / OUT)
    run_stage(repo, VLLM_PYTHON)                       # all cached: vLLM is not even started
    again = json.loads((repo / META).read_text())
    assert again["requests_asked"] == 0 and again["answers_from_cache"] == meta["requests_asked"]
    assert pd.read_parquet(repo / OUT).equals(frame)


def test_every_request_uses_the_json_schema_and_every_answer_is_counted(first_run):
    exchanges, meta = first_run["exchanges"], first_run["meta"]
    assert exchanges and all(e["path"] == "/v1/chat/completions" and e["status"] == 200 for e in exchanges)
    for e in exchanges:
        body = e["request"]
        assert body["model"] == SERVED and body["max_tokens"] == MAX_TOKENS and isinstance(body["seed"], int)
        assert body["response_format"]["type"] == "json_schema" and "guided_json" not in body
        schema = body["response_format"]["json_schema"]["schema"]
        assert schema["required"] == ["rewritten"] and schema["properties"]["rewritten"]["type"] == "string"
    # vLLM enforced the schema: every reply that ended by itself is that object (JSON read leniently: the grammar
    # lets raw control characters into strings, which the stage's strict reader counts as malformed_json)
    finished = [(e["response"]["choices"][0]["message"]["content"], e["request"]) for e in exchanges
                if e["response"]["choices"][0]["finish_reason"] == "stop"]
    assert finished, "every reply hit max_tokens: the schema check would be empty"
    for content, body in finished:
        obj = json.loads(content, strict=False)
        limit = body["response_format"]["json_schema"]["schema"]["properties"]["rewritten"]["maxLength"]
        # (the grammar counts an invalid UTF-8 byte run as one character; decoded, it is one U+FFFD per byte)
        text = obj["rewritten"]
        assert list(obj) == ["rewritten"] and text and len(text.replace("\ufffd", "")) <= limit
    assert_counts_add_up(first_run["repo"], meta, first_run["replies"])
    assert meta["reject_rate"] > 0 and meta["endpoint"] == first_run["base_url"] + "/chat/completions"
    assert Counter(a[2] for a in first_run["answers"].values()) == Counter(first_run["replies"])


def test_second_run_asks_nothing(first_run, server):
    _, proxy = server
    repo = first_run["repo"]
    proxy.exchanges.clear()
    run_stage(repo)
    meta = json.loads((repo / META).read_text())
    assert proxy.exchanges == []
    assert meta["requests_asked"] == 0 and meta["answers_from_cache"] == first_run["meta"]["requests_asked"]
    assert meta_without_run_statistics(meta) == meta_without_run_statistics(first_run["meta"])
    assert pd.read_parquet(repo / OUT).equals(first_run["frame"])


def test_killed_run_resumes_and_ends_with_the_uninterrupted_answers(first_run, server, workdir):
    _, proxy = server
    repo = make_project(workdir / "killed", backend="server", base_url=proxy.url, model=SERVED)
    proxy.exchanges.clear()
    proc = subprocess.Popen(stage_cmd(), cwd=repo, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for_cache(repo, proc, 60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    at_kill = cache_records(repo)
    assert 60 <= len(at_kill) < first_run["meta"]["requests_asked"]
    assert not (repo / OUT).exists()

    proxy.settle()
    proxy.exchanges.clear()
    run_stage(repo)
    meta = json.loads((repo / META).read_text())
    asked_again = {e["request"]["messages"][-1]["content"] for e in proxy.exchanges}
    answered_before = {build_prompt(r["caption"], r["type"], r["variant"]) for r in at_kill}
    assert not asked_again & answered_before                   # nothing answered before the kill is asked again
    assert meta["requests_asked"] == len(proxy.exchanges)
    assert meta["answers_from_cache"] == len(at_kill)
    assert meta["requests_asked"] + meta["answers_from_cache"] == first_run["meta"]["requests_asked"]
    # seeded per request: the same answers, negatives and counts as the uninterrupted run
    assert answers_by_request(cache_records(repo)) == first_run["answers"]
    assert meta_without_run_statistics(meta) == meta_without_run_statistics(first_run["meta"])
    assert pd.read_parquet(repo / OUT).equals(first_run["frame"])


def test_server_stopping_mid_run_names_the_url_and_keeps_the_answers(first_run, server, workdir):
    """Last: it stops the server. The stage talks to vLLM directly, so a stopped server refuses connections."""
    vllm, _ = server
    # vLLM's API server, stopped, keeps the connections of requests in flight open without answering them until
    # they close: the stage's per-request timeout bounds that wait
    repo = make_project(workdir / "stopped", backend="server", base_url=vllm.url, model=SERVED, timeout=10)
    proc = subprocess.Popen(stage_cmd(), cwd=repo, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_for_cache(repo, proc, 40)
        before = len(cache_records(repo))
        vllm.stop()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "EndpointError" in out and f"{vllm.url}/chat/completions" in out, out[-3000:]
    assert "Answers received so far are cached" in out
    kept = answers_by_request(cache_records(repo))
    assert len(kept) >= before
    assert all(first_run["answers"][k] == v for k, v in kept.items())     # real answers, kept as received
    assert not (repo / OUT).exists()
