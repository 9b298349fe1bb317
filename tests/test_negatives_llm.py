"""The `server` backend end to end against a local OpenAI-compatible server, and `offline` against a
stand-in `vllm` module. Answers come from the rules backend, so "good" replies are valid negatives."""
import json
import re
import sys
import threading
import time
import types
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from stages._common import StageParams, setup_logging

import pandas as pd
import pytest

from clipfinetune.data.negatives.degla.llm import TOP_P, EndpointError, OfflineBackend
from clipfinetune.data.negatives.degla.rules_backend import RulesBackend
from clipfinetune.data.negatives.degla.validators import RULES

ROOT = Path(__file__).resolve().parents[1]

GOOD = ["a large red circle to the left of a small blue square", "a small green star above a big purple hexagon",
        "two green triangles"]
BEHAVIOUR = {  # caption -> what the server does with it
    "a tiny red square next to a big blue circle": "flaky500",
    "a big yellow star below a small red triangle": "slow",
    "a small blue hexagon above a large green star": "badjson",
    "a large purple circle to the right of a tiny yellow square": "empty",
    "a big green triangle next to a small purple hexagon": "echo",
    "a small red star to the left of a large blue triangle": "overlong",
}
RULE_TO_TYPE = {v: k for k, v in RULES.items()}
TIMEOUT = 0.6


def parse_prompt(prompt):
    rule = re.search(r"examples: <([^>]*)>", prompt).group(1)
    caption = re.search(r"Input text: <([^>]*)>\s*\n", prompt).group(1)
    return caption, RULE_TO_TYPE[rule]


class FakeLLM:
    def __init__(self):
        self.rules = RulesBackend(seed=1)
        self.calls = Counter()
        self.total = 0
        self.lock = threading.Lock()

    def reply(self, prompt, attempt_key):
        caption, type_ = parse_prompt(prompt)
        with self.lock:
            self.total += 1
            self.calls[attempt_key] += 1
            n = self.calls[attempt_key]
        mode = BEHAVIOUR.get(caption, "good")
        if mode == "flaky500" and n <= 2:
            return 500, None
        if mode == "slow" and n == 1:
            time.sleep(TIMEOUT * 2)
        if mode == "badjson":
            return 200, "Sure! Here is the rewritten caption: ..."
        if mode == "empty":
            return 200, ""
        if mode == "echo":
            return 200, json.dumps({"rewritten": caption})
        if mode == "overlong":
            return 200, json.dumps({"rewritten": " and ".join([caption] * 5)})
        text = self.rules.answer(caption, type_, 0) or caption
        return 200, json.dumps({"rewritten": text})


@pytest.fixture()
def server():
    llm = FakeLLM()
    for caption in GOOD + list(BEHAVIOUR):   # warm spaCy/WordNet so the handler answers fast
        for t in RULES:
            llm.rules.answer(caption, t, 0)
    seen_payloads = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen_payloads.append(body)
            prompt = body["messages"][-1]["content"]
            status, content = llm.reply(prompt, json.dumps(body["messages"]))
            out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode() \
                if status == 200 else b'{"error": "boom"}'
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
            except OSError:
                pass   # the client gave up (timeout)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1", llm, seen_payloads, httpd
    httpd.shutdown()
    httpd.server_close()


def stage_params(base_url, captions_file, cache_dir, backend="server", max_retries=3):
    source = {"reader": "coco", "captions": str(captions_file), "images": str(Path(captions_file).parent)}
    return StageParams("negatives", {"sources": {"coco": source}, "negatives": {
        "sources": ["coco"], "backend": backend, "per_caption": 4, "cache_dir": str(cache_dir),
        "base_url": base_url, "model": "test-model", "api_key_env": "CFT_TEST_KEY", "concurrency": 4,
        "timeout": TIMEOUT, "max_retries": max_retries, "max_failures": 0, "backoff": 0.02, "max_tokens": 64,
        "temperature": 0.7, "seed": 0}})


def write_captions(path, captions):
    path.write_text(json.dumps({
        "images": [{"id": i, "file_name": f"{i}.jpg", "width": 8, "height": 8} for i in range(len(captions))],
        "annotations": [{"id": i, "image_id": i, "caption": c} for i, c in enumerate(captions)]}))


def test_server_backend_retries_rejects_caches_and_resumes(server, tmp_path, monkeypatch):
    from stages import negatives as stage

    base_url, llm, payloads, _ = server
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CFT_TEST_KEY", "secret")
    write_captions(tmp_path / "caps.json", GOOD + list(BEHAVIOUR))
    log = setup_logging("negatives")

    stats = stage.run(stage_params(base_url, tmp_path / "caps.json", tmp_path / "cache"), log)
    rej = stats["rejects"]
    assert rej.get("malformed_json", 0) >= 5 and rej.get("empty", 0) >= 5
    assert rej.get("unchanged", 0) >= 5 and rej.get("over_long", 0) >= 5
    assert stats["requests_failed"] == 0                     # 500s and the timeout were retried
    assert max(llm.calls.values()) >= 3                      # flaky captions needed retries
    frame = pd.read_parquet(tmp_path / "data/prepared/negatives.parquet")
    assert list(frame.columns) == ["image_id", "caption_index", "caption", "type", "negative"]
    flaky = frame[frame.caption.isin([c for c, m in BEHAVIOUR.items() if m in ("flaky500", "slow")])]
    assert len(flaky) == 8                                   # both recovered to 4 negatives
    assert not frame.caption.isin([c for c, m in BEHAVIOUR.items() if m == "echo"]).any()
    p = payloads[0]
    assert p["response_format"]["type"] == "json_schema" and p["max_tokens"] == 64 and "guided_json" not in p
    assert p["top_p"] == TOP_P                              # the offline engine's sampling (test below)
    metrics = json.loads((tmp_path / "metrics/negatives.json").read_text())["negatives"]
    assert metrics["backend"] == "server" and 0 < metrics["reject_rate"] < 100
    meta = json.loads((tmp_path / "data/prepared/negatives.meta.json").read_text())
    assert meta["model"].startswith("test-model") and meta["prompt_version"].startswith("degla-fewshot-")

    before = llm.total
    stats2 = stage.run(stage_params(base_url, tmp_path / "caps.json", tmp_path / "cache"), log)
    assert llm.total == before and stats2["requests_asked"] == 0   # nothing asked twice
    assert pd.read_parquet(tmp_path / "data/prepared/negatives.parquet").equals(frame)


def test_unreachable_server_names_the_url_and_keeps_finished_work(server, tmp_path, monkeypatch):
    from stages import negatives as stage

    base_url, _, _, httpd = server
    monkeypatch.chdir(tmp_path)
    write_captions(tmp_path / "a.json", GOOD[:1])
    log = setup_logging("negatives")
    stage.run(stage_params(base_url, tmp_path / "a.json", tmp_path / "cache", max_retries=1), log)
    cache_file = next((tmp_path / "cache").glob("*.jsonl"))
    cached = len(cache_file.read_text().splitlines())
    httpd.shutdown()
    httpd.server_close()
    write_captions(tmp_path / "b.json", GOOD)
    with pytest.raises(EndpointError, match=re.escape(base_url)):
        stage.run(stage_params(base_url, tmp_path / "b.json", tmp_path / "cache", max_retries=1), log)
    assert len(cache_file.read_text().splitlines()) >= cached


@pytest.mark.parametrize("platform", ["cuda", "cpu", None])
def test_offline_backend_with_a_stand_in_vllm(monkeypatch, platform):
    """platform: what the stand-in's vllm.platforms reports (None: an old vLLM without that module)."""
    calls = {}
    rules = RulesBackend(seed=1)

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class StructuredOutputsParams:
        def __init__(self, json=None):
            self.json = json

    class LLM:
        def __init__(self, model, **kw):
            calls["init"] = dict(model=model, **kw)

        def chat(self, conversations, params, use_tqdm=False):
            calls.setdefault("params", []).extend(params)
            outs = []
            for conv in conversations:
                caption, type_ = parse_prompt(conv[-1]["content"])
                text = json.dumps({"rewritten": rules.answer(caption, type_) or ""})
                outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(text=text)]))
            return outs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = LLM, SamplingParams, "0.12-stand-in"
    sp = types.ModuleType("vllm.sampling_params")
    sp.StructuredOutputsParams = StructuredOutputsParams
    vllm.sampling_params = sp
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    if platform is not None:
        platforms = types.ModuleType("vllm.platforms")
        platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: platform == "cpu")
        monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    else:
        monkeypatch.setitem(sys.modules, "vllm.platforms", None)     # import fails

    from clipfinetune.data.negatives.degla.llm import Request

    backend = OfflineBackend("some/model", max_tokens=50, temperature=0.5, seed=3, batch=2)
    got = []
    reqs = [Request(f"{i:032x}", GOOD[0], t) for i, t in enumerate(RULES)]
    backend.run(reqs, lambda req, text, err, raw: got.append((req.type, text, err)))
    assert calls["init"]["model"] == "some/model" and calls["init"]["generation_config"] == "vllm"
    assert all(p.kw["max_tokens"] == 50 and isinstance(p.kw["structured_outputs"], StructuredOutputsParams)
               for p in calls["params"])
    assert all(p.kw["top_p"] == TOP_P and p.kw["temperature"] == 0.5 for p in calls["params"])   # as the server's
    assert len(got) == 5 and all(err is None and text for _, text, err in got)
    assert backend.vllm_version == "0.12-stand-in"
    # vLLM's CPU build dies on seeded requests after a chunked prefill (make test-vllm): there it is turned off,
    # with a token budget that still admits a whole prompt of max_model_len tokens
    init = calls["init"]
    if platform == "cpu":
        assert init["enable_chunked_prefill"] is False and init["max_num_batched_tokens"] >= init["max_model_len"]
    else:
        assert "enable_chunked_prefill" not in init and "max_num_batched_tokens" not in init


def test_offline_backend_caches_each_batch_as_it_returns_and_a_kill_loses_one_batch(monkeypatch, tmp_path):
    """Large batches go to `llm.chat` whole (not in smaller waiting chunks), requests are read lazily, and each
    batch's answers are in the cache before the next batch is submitted: killed during batch 3, the cache holds
    batches 1 and 2 and a re-run asks only the rest."""
    from clipfinetune.data.negatives.degla.cache import AnswerCache
    from clipfinetune.data.negatives.degla.llm import Request

    submitted, taken = [], []

    class Killed(BaseException):
        pass

    class LLM:
        kill_on_call = 3

        def __init__(self, model, **kw):
            pass

        def chat(self, conversations, params, use_tqdm=False):
            submitted.append([parse_prompt(c[-1]["content"])[0] for c in conversations])
            if len(submitted) == self.kill_on_call:
                raise Killed
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                text=json.dumps({"rewritten": "not " + parse_prompt(c[-1]["content"])[0]}))]) for c in conversations]

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams, vllm.__version__ = LLM, lambda **kw: kw, "stand-in"
    sp = types.ModuleType("vllm.sampling_params")
    sp.StructuredOutputsParams = lambda json=None: json
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    monkeypatch.setitem(sys.modules, "vllm.platforms", None)

    reqs = [Request(f"{i:032x}", f"caption {i}", "swap_nouns") for i in range(10)]

    def lazily():
        for r in reqs:
            taken.append(r.key)
            yield r

    path = tmp_path / "answers.jsonl"

    def ask(requests):
        with AnswerCache(path) as cache:
            def on_result(req, text, err, raw):
                # the batch is over before its answers arrive: no request of a later batch has been read yet
                assert len(taken) <= 4 * len(submitted)
                cache.append({"key": req.key, "caption": req.caption, "type": req.type, "variant": 0,
                              "text": text, "error": err, "raw": raw})
            OfflineBackend("m", batch=4).run(requests, on_result)

    with pytest.raises(Killed):
        ask(lazily())
    assert submitted == [[f"caption {i}" for i in range(4)], [f"caption {i}" for i in range(4, 8)],
                         ["caption 8", "caption 9"]]
    cached = [json.loads(line) for line in path.read_text().splitlines()]
    assert [c["key"] for c in cached] == [r.key for r in reqs[:8]]           # the killed batch alone is lost
    assert all(c["text"] == "not " + c["caption"] for c in cached)

    # the re-run asks only what the cache lacks (as generate_negatives does: requests minus cached keys)
    submitted.clear()
    taken.clear()
    LLM.kill_on_call = 0
    done = {c["key"] for c in cached}
    ask([r for r in reqs if r.key not in done])
    assert submitted == [["caption 8", "caption 9"]]
    assert len(path.read_text().splitlines()) == 10
