"""Figure 6: the negatives stage's server client at throughput (issue 34).

The real client (`ServerBackend` of clipfinetune/data/negatives/degla/llm.py: aiohttp, `in_flight` requests in
flight, DeGLA prompts built per request, answers parsed) asks `n_requests` synthetic (caption, rewrite type)
requests of a local OpenAI-compatible stub that answers at once. The stub runs in another process (aiohttp.web on
127.0.0.1), so the client's requests/s and resident memory are the client's own. RSS is read at checkpoints
(10K, then every 50K requests answered): a client that kept every request or future would grow with n.

`run_client_against_stub(n_requests, in_flight) -> dict` is what the COCO-sized rehearsal calls;
`run_client(base_url, model, n_requests, in_flight)` measures any endpoint, e.g. the vLLM CPU server of
`make test-vllm` at 8 vs 64 in flight (`--vllm BASE_URL --model NAME`, see `vllm_figure`; `--vllm-cpu` starts that
server itself, see `vllm_cpu_figure`).

    python -m benchmarks.fig6_negatives --requests 200000 --in-flight 256
    python -m benchmarks --only 6
    python -m benchmarks.fig6_negatives --vllm-cpu     # 8 vs 64 in flight, real vLLM on CPU (256 requests each)
"""
from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from .common import Row

CHECKPOINTS = (10_000,)
CHECK_EVERY = 50_000
ANSWER = json.dumps({"object": "chat.completion", "model": "stub", "choices": [
    {"index": 0, "finish_reason": "stop",
     "message": {"role": "assistant", "content": json.dumps({"rewritten": "a small dog chasing a red ball"})}}]})
COLOURS = ["red", "blue", "green", "yellow", "white", "black", "brown", "grey"]
THINGS = ["dog", "cat", "man", "woman", "bus", "train", "horse", "kite", "plate", "table", "bike", "boat"]
PLACES = ["on a street", "in a field", "near a lake", "on a table", "by the sea", "in a kitchen", "in a park"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _serve(conn) -> None:
    """The stub, in its own process: POST /v1/chat/completions -> one fixed chat completion, at once."""
    import asyncio

    from aiohttp import web

    async def chat(request):
        await request.read()
        return web.Response(text=ANSWER, content_type="application/json")

    async def main():
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=2048)
        await site.start()
        conn.send(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


class Stub:
    """The stub server process (spawned, so it shares no memory with the client); a context manager."""

    def __enter__(self):
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        if not parent.poll(60):
            self.proc.kill()
            raise RuntimeError("the stub server did not start within 60 s")
        self.base_url = f"http://127.0.0.1:{parent.recv()}/v1"
        return self

    def cpu_s(self) -> float:
        """The stub process's CPU seconds so far (user + system, from /proc)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.join(10)


def synthetic_requests(n: int):
    """n distinct (caption, rewrite type) requests, made lazily (as the stage's list would be, minus the list)."""
    from clipfinetune.data.negatives.degla.cache import answer_key
    from clipfinetune.data.negatives.degla.llm import Request
    from clipfinetune.data.negatives.degla.validators import TYPES

    combos = list(itertools.product(COLOURS, THINGS, PLACES, TYPES))
    for i in range(n):
        colour, thing, place, type_ = combos[i % len(combos)]
        caption = f"a {colour} {thing} {place} number {i // len(combos)}"
        yield Request(answer_key(caption, type_, 0, "bench", "server", "stub"), caption, type_)


def run_client(base_url: str, model: str, n_requests: int, in_flight: int, cache: bool = False,
               max_tokens: int = 64, log=None) -> dict:
    """The real client over n synthetic requests against base_url; requests/s and this process's RSS."""
    from clipfinetune.data.negatives.degla.cache import AnswerCache
    from clipfinetune.data.negatives.degla.llm import ServerBackend

    backend = ServerBackend(base_url, model, concurrency=in_flight, timeout=120, max_retries=2, backoff=0.5,
                            max_tokens=max_tokens, progress_every=30)
    rss_at: dict[str, float] = {}
    answered = 0
    with tempfile.TemporaryDirectory() as tmp:
        store = AnswerCache(os.path.join(tmp, "answers.jsonl")) if cache else None

        def on_result(req, text, error, raw):
            nonlocal answered
            answered += 1
            if store is not None:
                store.append({"key": req.key, "caption": req.caption, "type": req.type, "variant": req.variant,
                              "text": text, "error": error, "raw": raw})
            if answered in CHECKPOINTS or answered % CHECK_EVERY == 0 or answered == n_requests:
                rss_at[str(answered)] = round(rss_mb(), 1)
                if log:
                    log(f"  {answered} answered, RSS {rss_at[str(answered)]} MB")

        rss_start = rss_mb()
        t0, cpu0 = time.perf_counter(), time.process_time()
        stats = backend.run(synthetic_requests(n_requests), on_result, total=n_requests)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if store is not None:
            store.close()
    return {"requests": n_requests, "answered": answered, "in_flight": in_flight, "failed": stats["failed"],
            "seconds": round(seconds, 2), "requests_per_s": round(answered / seconds, 1),
            # the client's own CPU: on a shared machine, the rate one free core would give
            "client_cpu_s": round(cpu, 2), "requests_per_client_cpu_s": round(answered / max(cpu, 1e-9), 1),
            "load_avg_1min": os.getloadavg()[0],
            "rss_mb_start": round(rss_start, 1), "rss_mb_at": rss_at, "peak_rss_mb": max(rss_at.values(), default=0),
            "cache": cache, "client": "ServerBackend (aiohttp)", "endpoint": base_url}


def run_client_against_stub(n_requests: int = 200_000, in_flight: int = 256, cache: bool = False, log=None) -> dict:
    """The client against the local stub (another process) that answers at once: see the module docstring."""
    with Stub() as stub:
        cpu0 = stub.cpu_s()
        out = run_client(stub.base_url, "stub", n_requests, in_flight, cache=cache, log=log)
        return {**out, "server": "stub", "stub_cpu_s": round(stub.cpu_s() - cpu0, 2)}


def vllm_figure(base_url: str, model: str, n_requests: int = 256, in_flights=(8, 64), log=print) -> list[dict]:
    """Requests/s of the client at each number in flight against a running vLLM server (warmed up first)."""
    out = []
    run_client(base_url, model, 16, 8)                     # warm-up
    for k in in_flights:
        r = run_client(base_url, model, n_requests, k, log=log)
        log(f"vLLM, {k} in flight: {r['requests_per_s']} req/s ({r['seconds']} s, load {r['load_avg_1min']:.1f})")
        out.append({**r, "server": base_url})
    return out


VLLM_PYTHON = Path.home() / ".cache/clipfinetune/venv-vllm/bin/python"      # what `make test-vllm` builds
# as tests/real_vllm/test_vllm_negatives.py starts it: a random tiny Llama on vLLM's CPU build (chunked prefill
# off: seeded requests crash it there)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}
VLLM_CPU_FLAGS = ("--max-model-len", "1024", "--dtype", "float32", "--no-enable-chunked-prefill",
                  "--max-num-batched-tokens", "1024", "--enforce-eager")


def vllm_cpu_figure(n_requests: int = 256, in_flights=(8, 64), vllm_python: Path = VLLM_PYTHON, log=print,
                    start_s: float = 600) -> list[dict]:
    """`vllm_figure` against the real vLLM CPU server of `make test-vllm`: builds the random tiny Llama of
    tests/real_vllm/tiny_llama.py (tokenizer trained on the synthetic captions), serves it on 127.0.0.1 with
    `vllm_python -m vllm.entrypoints.openai.api_server`, measures 8 vs 64 in flight, stops the server."""
    import signal
    import socket
    import subprocess
    import urllib.request

    if not Path(vllm_python).is_file():
        raise FileNotFoundError(f"{vllm_python}: no vLLM venv; `make test-vllm` builds it")
    env = {**os.environ, **VLLM_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        captions = [{"id": i, "image_id": i, "caption": r.caption} for i, r in enumerate(synthetic_requests(2000))]
        (tmp / "captions.json").write_text(json.dumps({"images": [], "annotations": captions}))
        tiny = Path(__file__).resolve().parents[1] / "tests/real_vllm/tiny_llama.py"
        subprocess.run([str(vllm_python), str(tiny), "--captions", str(tmp / "captions.json"),
                        "--out", str(tmp / "model")], env=env, check=True, timeout=600)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        base_url = f"http://127.0.0.1:{port}/v1"
        with open(tmp / "server.log", "w") as server_log:
            proc = subprocess.Popen([str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                     str(tmp / "model"), "--served-model-name", "tiny-llama", "--host", "127.0.0.1",
                                     "--port", str(port), *VLLM_CPU_FLAGS], env=env, stdout=server_log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + start_s
            while True:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server did not come up:\n{(tmp / 'server.log').read_text()[-3000:]}")
                try:
                    with urllib.request.urlopen(f"{base_url}/models", timeout=5) as r:
                        if b"tiny-llama" in r.read():
                            break
                except OSError:
                    pass
                time.sleep(1)
            return vllm_figure(base_url, "tiny-llama", n_requests, in_flights, log=log)
        finally:                  # the API server and its engine core: the whole process group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


def figure(log=print, n_requests: int = 200_000, in_flight: int = 256) -> list[Row]:
    r = run_client_against_stub(n_requests, in_flight, log=log)
    cmd = f"python -m benchmarks.fig6_negatives --requests {n_requests} --in-flight {in_flight}"
    at = r["rss_mb_at"]
    first, last = at.get(str(CHECKPOINTS[0])), at.get(str(n_requests))
    growth = None if first is None or last is None else last - first
    return [Row(f"6 negatives client req/s ({n_requests} requests, {in_flight} in flight, stub)", r["requests_per_s"],
                None, None, ">= 1000", r["requests_per_s"] >= 1000 and r["failed"] == 0, "req/s", r, [cmd]),
            Row(f"6 negatives client RSS growth {CHECKPOINTS[0]} -> {n_requests} requests", growth, None, None,
                "<= 32 MB (flat)", growth is not None and growth <= 32, "MB", r, [cmd])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fig6_negatives", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per measurement (default 200,000 against the stub, 256 against vLLM)")
    ap.add_argument("--in-flight", type=int, default=256)
    ap.add_argument("--cache", action="store_true", help="also append every answer to an AnswerCache (tmp dir)")
    ap.add_argument("--vllm", default="", metavar="BASE_URL", help="against a running vLLM server: 8 vs 64 in flight")
    ap.add_argument("--model", default="", help="with --vllm: the served model's name")
    ap.add_argument("--vllm-cpu", action="store_true", help="start `make test-vllm`'s vLLM CPU server with a tiny "
                    "random Llama (~/.cache/clipfinetune/venv-vllm) and measure 8 vs 64 in flight")
    args = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.requests is None:         # a CPU vLLM answers ~10-40 req/s: 200,000 would take hours
        args.requests = 256 if args.vllm_cpu or args.vllm else 200_000
    if args.vllm_cpu:
        print(json.dumps(vllm_cpu_figure(args.requests, log=log), indent=1))
        return 0
    if args.vllm:
        print(json.dumps(vllm_figure(args.vllm, args.model, args.requests, log=log), indent=1))
        return 0
    print(json.dumps(run_client_against_stub(args.requests, args.in_flight, cache=args.cache, log=log), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
