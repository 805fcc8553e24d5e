"""A scripted fake vLLM engine (ASGI): replays chosen token ids, for unit tests and gateway benchmarks.

It speaks the subset of vLLM's API the gateway uses: ``/v1/completions`` with token-id prompts,
``return_token_ids``, ``return_tokens_as_token_ids`` and ``logprobs`` (streamed or not), ``/v1/models``
and ``/health``. Logprobs are a deterministic function of position and token id. ``/metrics`` serves a
few of vLLM's Prometheus metrics under vLLM's names, counted from the requests it served (`FakeStats`).

Weight updates speak vLLM's development endpoints as ``EngineClient.update_weights`` calls them:
``/pause``, ``/resume``, ``/collective_rpc`` (only ``reload_weights``: the path must be a directory with
a ``config.json``, else HTTP 500 as vLLM answers a failed load), ``/update_weight_version`` and
``/weight_info``. Generated tokens depend on the version (`versioned_context`), so a test can tell
which version produced each token; under vLLM's initial version (``default``) they are as before.

``/v1/chat/completions`` answers any messages with a fixed text, one word per token and as many tokens
(stream chunks) as ``/v1/completions`` would produce, so that chat clients (a LiteLLM proxy, a direct
client in ``belayer bench gateway``) can call the same engine as the gateway.

>>> import asyncio
>>> engine = FakeEngine(outputs=[[11, 12, 2]])      # the next request gets tokens 11, 12, 2
>>> async def complete() -> dict[str, Any]:
...     async with httpx.AsyncClient(transport=httpx.ASGITransport(engine.app()), base_url="http://e") as http:
...         r = await http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 8})
...     return dict(r.json()["choices"][0])
>>> asyncio.run(complete())
{'index': 0, 'text': '', 'token_ids': [11, 12, 2], 'finish_reason': 'stop'}
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.keyed import choose
from core.worker_auth import RequireApiKey
from engine_pool.client import REQUEST_ID_HEADER, session_of_request

Script = Callable[[list[int]], list[int]]

CHAT_WORDS = ("Hello", " from", " the", " fake", " engine", ".")


def versioned_context(context: list[int], version: str) -> list[int]:
    """What a fake engine's step function sees under weight `version`: the context, with one more
    token (a checksum of the version) under any version but vLLM's initial ``default``.

    >>> versioned_context([5, 6], "default"), versioned_context([5, 6], "v2")
    ([5, 6], [5, 6, 4399])
    """
    return context if version == "default" else [*context, zlib.crc32(version.encode()) % 5000]


def fake_logprob(position: int, token_id: int) -> float:
    return -0.25 - 0.01 * position - token_id * 1e-5


@dataclass(slots=True)
class FakeStats(Collector):
    """What ``/metrics`` reports, as vLLM names it: requests running, tokens, KV-cache usage, and the
    prefix cache, which like vLLM's caches whole blocks of ``block_size`` tokens (prompt and output) and
    counts a prompt's leading cached blocks as hits.

    >>> stats = FakeStats(block_size=2)
    >>> stats.admit([1, 2, 3, 4, 5], [6]); stats.admit([1, 2, 3, 4, 5, 6, 7], [8])
    >>> stats.prefix_cache_queries, stats.prefix_cache_hits
    (12, 6)
    """

    model: str = "fake"
    block_size: int = 16
    kv_cache_tokens: int = 65536
    max_cached_blocks: int = 1 << 16
    running: int = 0
    running_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    _cached: set[int] = field(default_factory=set)

    def _blocks(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full blocks of `ids`: a block's hash stands for its whole prefix."""
        hashes, h = [], 0
        for start in range(0, len(ids) - self.block_size + 1, self.block_size):
            h = hash((h, *ids[start : start + self.block_size]))
            hashes.append(h)
        return hashes

    def admit(self, prompt: list[int], output: list[int]) -> None:
        """A request starts: its prompt is looked up in the prefix cache and its blocks are cached."""
        prompt_blocks = self._blocks(prompt)
        hit = next((i for i, h in enumerate(prompt_blocks) if h not in self._cached), len(prompt_blocks))
        self.prefix_cache_queries += len(prompt)
        self.prefix_cache_hits += hit * self.block_size
        self.prompt_tokens += len(prompt)
        if len(self._cached) > self.max_cached_blocks:
            self._cached.clear()  # evicted all at once: it is a fake
        self._cached.update(self._blocks(prompt + output))
        self.running += 1
        self.running_tokens += len(prompt) + len(output)

    def finish(self, prompt: list[int], output: list[int], sent: int) -> None:
        """A request ends, `sent` of its output tokens sent."""
        self.running -= 1
        self.running_tokens -= len(prompt) + len(output)
        self.generation_tokens += sent

    def collect(self) -> list[Metric]:
        labels = ["engine", "model_name"]  # in vLLM's order
        values = ["0", self.model]

        def gauge(name: str, about: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, about, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, about: str, value: float) -> Metric:
            family = CounterMetricFamily(name, about, labels=labels)
            family.add_metric(values, value)
            return family

        usage = min(1.0, self.running_tokens / self.kv_cache_tokens)
        return [
            gauge(
                "vllm:num_requests_running", "Number of requests in model execution batches.", self.running
            ),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 0),
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            counter(
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                self.prefix_cache_queries,
            ),
            counter(
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                self.prefix_cache_hits,
            ),
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens),
            counter(
                "vllm:generation_tokens", "Number of generation tokens processed.", self.generation_tokens
            ),
        ]


@dataclass(slots=True)
class FakeEngine:
    """``outputs`` are served in order, one per request; ``script`` is used once they run out."""

    outputs: list[list[int]] = field(default_factory=list)
    script: Script | None = None
    session_script: Callable[[list[int], str | None], list[int]] | None = None
    """Used in place of ``script`` when given: it is also told the session each request is for (from
    the gateway's ``X-Request-Id``, see `engine_request_id`; None for a request without one)."""
    model: str = "fake"
    max_model_len: int = 4096
    token_delay: float = 0.0
    token_delay_max: float | None = None
    """When set, each stream draws its delay between tokens from [token_delay, token_delay_max] (streams
    at realistic, uneven rates: ``belayer bench scale``)."""
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    requests: list[dict[str, Any]] = field(default_factory=list)
    reject_next: str | None = None  # answer the next request with this 400 message
    poison: Callable[[list[int]], bool] | None = None
    """Prompts this engine answers with HTTP 500 (a request that crashes the engine's handler)."""
    query_of_death: Callable[[dict[str, Any]], bool] | None = None
    """Requests (their bodies) that kill this engine's process before their first token, as vLLM 0.32
    dies on a seeded prompt whose prefill spans scheduler steps (`seeded_over`; a launched fake worker's
    ``--die-on-seeded-prompts-over``)."""
    # Autoregressive mode: each token is a function of the whole context, like greedy decoding, so a
    # request resumed from prompt + k generated tokens yields exactly the rest (failover tests).
    step: Callable[[list[int]], int] | None = None
    policy: Callable[[list[int]], list[float]] | None = None
    """Sampled mode: the logits of the token after a context. A request with keyed sampling's
    ``vllm_xargs`` (``core.keyed``) is drawn from them by its key and positions, as ``belayer_vllm.keyed``
    draws inside vLLM; any other from this engine's own `rng`, as vLLM's sampler (a failover re-draws)."""
    eos_id: int | None = None
    # Fault hook: called with (prompt, tokens sent so far) before a non-streamed answer (None) and after
    # each streamed token; a harness test's engine process exits in it to die mid-stream for real.
    crash: Callable[[list[int], int | None], None] | None = None
    stats: FakeStats = field(default_factory=FakeStats)
    weight_version: str = "default"
    """The weight version this engine holds (vLLM's initial one is ``default``)."""
    weights_path: str | None = None
    """The path of the weights last loaded by ``reload_weights`` (None: the launch weights)."""
    paused: bool = False
    update_error: str | None = None
    """While set, every ``reload_weights`` fails with this message (HTTP 500); the weights stay."""

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        assert self.step is not None
        context, out = list(prompt), list[int]()
        while len(out) < max_tokens:
            t = self.step(versioned_context(context, self.weight_version))
            out.append(t)
            context.append(t)
            if t == self.eos_id:
                break
        return out

    def sampled(self, prompt: list[int], body: dict[str, Any]) -> list[int]:
        """`policy`'s tokens for a request: keyed (``core.keyed.choose``) or from `rng`."""
        assert self.policy is not None
        args = body.get("vllm_xargs") or {}
        key, start = args.get("belayer_key"), int(args.get("belayer_position", 0))
        temperature = float(args.get("belayer_temperature", body.get("temperature", 1.0)))
        top_p = float(args.get("belayer_top_p", body.get("top_p", 1.0)))
        top_k = args.get("belayer_top_k", body.get("top_k"))
        context, out = list(prompt), list[int]()
        while len(out) < int(body.get("max_tokens") or 16):
            logits = self.policy(versioned_context(context, self.weight_version))
            if key is not None:
                t = choose(logits, int(key), start + len(out), temperature, top_p, top_k)[0]
            elif temperature < 1e-5:
                t = max(range(len(logits)), key=lambda i: (logits[i], -i))
            else:
                top = max(logits)
                weights = [math.exp((x - top) / temperature) for x in logits]
                t = self.rng.choices(range(len(logits)), weights)[0]
            out.append(t)
            context.append(t)
            if t == self.eos_id:
                break
        return out

    def next_output(
        self, prompt: list[int], max_tokens: int | None = None, session: str | None = None
    ) -> list[int]:
        if self.outputs:
            return self.outputs.pop(0)
        if self.step is not None:
            return self.greedy(prompt, max_tokens or self.max_model_len - len(prompt))
        if self.session_script is not None:
            return self.session_script(prompt, session)
        if self.script is not None:
            return self.script(prompt)
        salt = versioned_context([], self.weight_version)
        base = prompt[-1] + sum(salt) if prompt else 0
        return [(base * 31 + i * 7) % 200 + 10 for i in range(8)] if prompt else [10]

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/pause", self._pause, methods=["POST"]),
                Route("/resume", self._resume, methods=["POST"]),
                Route("/collective_rpc", self._collective_rpc, methods=["POST"]),
                Route("/update_weight_version", self._update_weight_version, methods=["POST"]),
                Route("/weight_info", self._weight_info, methods=["GET"]),
            ]
        )

    async def _pause(self, request: Request) -> Response:
        self.paused = True
        return JSONResponse({"status": "paused"})

    async def _resume(self, request: Request) -> Response:
        self.paused = False
        return JSONResponse({"status": "resumed"})

    async def _collective_rpc(self, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict) or body.get("method") != "reload_weights":
            return JSONResponse(
                {"error": {"message": "fake engine runs only reload_weights"}}, status_code=400
            )
        path = (body.get("kwargs") or {}).get("weights_path")
        if self.update_error is not None:
            return JSONResponse({"error": {"message": self.update_error}}, status_code=500)
        if not isinstance(path, str) or not (Path(path) / "config.json").is_file():
            message = f"Call to collective_rpc method failed: no model at {path!r}"
            return JSONResponse({"error": {"message": message}}, status_code=500)
        self.weights_path = path
        return JSONResponse({"results": [None]})

    async def _update_weight_version(self, request: Request) -> Response:
        body = await request.json()
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            return JSONResponse({"error": {"message": "new_version: a string"}}, status_code=400)
        self.weight_version = version
        return JSONResponse({"success": True, "new_version": version})

    async def _weight_info(self, request: Request) -> Response:
        # (vLLM's answer has the version only; the path is the fake's, for tests)
        return JSONResponse({"weight_version": self.weight_version, "weights_path": self.weights_path})

    async def _metrics(self, request: Request) -> Response:
        self.stats.model = self.model
        return Response(generate_latest(self.stats), media_type=CONTENT_TYPE_LATEST)

    def _stream_delay(self) -> float:
        """This stream's delay between tokens (the first token's included)."""
        if self.token_delay_max is None or self.token_delay_max <= self.token_delay:
            return self.token_delay
        return self.rng.uniform(self.token_delay, self.token_delay_max)

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        prompt = body.get("prompt")
        if self.reject_next is not None:
            message, self.reject_next = self.reject_next, None
            return JSONResponse({"error": {"message": message, "type": "BadRequestError"}}, status_code=400)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return JSONResponse({"error": {"message": "fake engine takes token-id prompts"}}, status_code=400)
        if self.poison is not None and self.poison(prompt):
            return JSONResponse({"error": {"message": "EngineCore hit an exception"}}, status_code=500)
        if self.query_of_death is not None and self.query_of_death(body):
            return StreamingResponse(_die(), media_type="text/event-stream")
        if len(prompt) + int(body.get("max_tokens") or 0) > self.max_model_len:
            msg = f"This model's maximum context length is {self.max_model_len} tokens."
            return JSONResponse({"error": {"message": msg, "type": "BadRequestError"}}, status_code=400)
        session = session_of_request(request.headers.get(REQUEST_ID_HEADER))
        if self.policy is not None:
            out = self.sampled(prompt, body)
        else:
            out = self.next_output(prompt, body.get("max_tokens"), session)
        max_tokens = int(body.get("max_tokens") or len(out))
        hit_eos = bool(out) and out[-1] == self.eos_id
        finish = "length" if len(out) > max_tokens or ((self.step or self.policy) and not hit_eos) else "stop"
        out = out[:max_tokens]
        k = body.get("logprobs")
        if body.get("prompt_logprobs") is not None:  # like vLLM: each prompt token's own logprob
            entries = [None] + [
                {str(t): {"logprob": fake_logprob(-1 - i, t), "rank": 1}} for i, t in enumerate(prompt[1:], 1)
            ]
            choice = {**self._choice(out, 0, k, finish), "prompt_logprobs": entries}
            return JSONResponse({"object": "text_completion", "model": self.model, "choices": [choice]})
        if body.get("stream"):
            stream = self._stream(prompt, out, k, finish)
            return StreamingResponse(stream, media_type="text/event-stream")
        if self.crash is not None:
            self.crash(prompt, None)
        self.stats.admit(prompt, out)
        self.stats.finish(prompt, out, len(out))
        choice = self._choice(out, 0, k, finish)
        return JSONResponse({"object": "text_completion", "model": self.model, "choices": [choice]})

    @staticmethod
    def _choice(ids: list[int], start: int, k: int | None, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "text": "", "token_ids": ids, "finish_reason": finish}
        if k is not None:
            lps = [fake_logprob(start + i, t) for i, t in enumerate(ids)]
            tops = [
                {f"token_id:{t}": lp, **{f"token_id:{t + j}": lp - j for j in range(1, k + 1)}}
                for t, lp in zip(ids, lps, strict=True)
            ]
            tokens = [f"token_id:{t}" for t in ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}
        return choice

    async def _stream(
        self, prompt: list[int], out: list[int], k: int | None, finish: str
    ) -> AsyncIterator[str]:
        self.stats.admit(prompt, out)
        sent, delay = 0, self._stream_delay()
        try:
            for i, tid in enumerate(out):
                if delay:
                    await asyncio.sleep(delay)
                last = i == len(out) - 1
                choice = self._choice([tid], i, k, finish if last else None)
                event = {"object": "text_completion", "model": self.model, "choices": [choice]}
                yield f"data: {json.dumps(event)}\n\n"
                sent += 1
                if self.crash is not None:
                    self.crash(prompt, i + 1)
            if not out:
                event = {"object": "text_completion", "choices": [self._choice([], 0, k, finish)]}
                yield f"data: {json.dumps(event)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.stats.finish(prompt, out, sent)

    async def _chat_completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            error = {"message": "fake engine takes a non-empty 'messages' list"}
            return JSONResponse({"error": error}, status_code=400)
        out = self.next_output([len(messages)])
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or len(out))
        finish = "length" if len(out) > max_tokens else "stop"
        words = [CHAT_WORDS[i % len(CHAT_WORDS)] for i in range(min(len(out), max_tokens))]
        n_in, n_out = len(messages), len(words)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        head = {"id": f"chatcmpl-fake-{len(self.requests)}", "created": int(time.time()), "model": self.model}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            stream = self._chat_stream(head, words, finish, usage if include_usage else None)
            return StreamingResponse(stream, media_type="text/event-stream")
        message = {"role": "assistant", "content": "".join(words)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return JSONResponse({**head, "object": "chat.completion", "choices": [choice], "usage": usage})

    async def _chat_stream(
        self, head: dict[str, Any], words: list[str], finish: str, usage: dict[str, int] | None
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk"}
        delay = self._stream_delay()
        for i, word in enumerate(words):
            if delay:
                await asyncio.sleep(delay)
            delta = {"role": "assistant", "content": word} if i == 0 else {"content": word}
            last = i == len(words) - 1
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish if last else None}
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        if not words:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": finish}
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        if usage is not None:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


async def _die() -> AsyncIterator[str]:
    """The answer of an engine that a request crashes: its headers, then the process is gone."""
    os._exit(70)
    yield ""  # pragma: no cover (a generator, never reached)


DIE_OVER_ENV = "BELAYER_FAKE_DIE_OVER"
"""Launched fake workers take no arguments of their own (``--vllm-arg`` is vLLM's): this variable, in the
gateway's environment, gives them ``--die-on-seeded-prompts-over``."""
TOKEN_DELAY_ENV = "BELAYER_FAKE_TOKEN_DELAY"
"""And this one their ``--token-delay``."""
ENGINE_CORE_ENV = "BELAYER_FAKE_ENGINE_CORE"
"""And this one (``1``) their ``--engine-core``."""
ENGINE_CORE_TITLE = "VLLM::EngineCore"


def engine_core() -> subprocess.Popen[bytes]:
    """A stand-in for vLLM's engine core process: a child titled as vLLM titles its own, which does
    nothing. When it dies, the fake server lingers and streams on, as vLLM's API server lingers after
    its engine core died (until its watchdog looks): only a watch of the worker's processes
    (``engine_pool.exits``) tells the gateway."""
    return subprocess.Popen([ENGINE_CORE_TITLE, "infinity"], executable=shutil.which("sleep") or "/bin/sleep")


def seeded_over(tokens: int) -> Callable[[dict[str, Any]], bool]:
    """vLLM 0.32's query of death on the CPU: a seeded request with a prompt over `tokens` tokens.

    >>> seeded_over(3)({"prompt": [1, 2, 3, 4], "seed": 7}), seeded_over(3)({"prompt": [1, 2, 3, 4]})
    (True, False)
    """
    return lambda body: body.get("seed") is not None and len(body.get("prompt") or ()) > tokens


@dataclass(slots=True)
class Fault:
    """What happens to the next request to one host: ``drop_after`` N streamed events then a reset
    connection; ``refuse`` the connection; ``stall_after`` N events then silence (a hung worker)."""

    kind: str
    after: int = 0


class LatentEngine:
    """An ASGI wrapper that makes each completion take `latency_s` first: an LLM call's bubble."""

    def __init__(self, app: Any, latency_s: float) -> None:
        self.app, self.latency_s = app, latency_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            await asyncio.sleep(self.latency_s)
        await self.app(scope, receive, send)


class FaultInjector(httpx.AsyncBaseTransport):
    """A transport in front of fake engines that injects the failures real workers have: the same
    exceptions httpx raises when a worker is killed (``RemoteProtocolError``, ``ConnectError``) or hangs.

    ``faults[host]`` is a queue consumed one generation request at a time; ``hung`` hosts also fail
    their health checks (time out), like a SIGSTOPped worker. A generation request that `kills` returns
    True for (given its body) is a query of death: its host goes ``down`` (it refuses every connection
    from then on, probes included) and the request's stream is reset before its first token (with
    `kill_with_error`, after an error event, as a server whose engine process died answers);
    ``killed`` lists the hosts it took down, in order.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.faults: dict[str, list[Fault]] = {}
        self.hung: set[str] = set()
        self.down: set[str] = set()
        self.kills: Callable[[dict[str, Any]], bool] | None = None
        self.kill_with_error = False
        self.killed: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.kills is not None and request.url.path == "/v1/completions":
            body = json.loads(await request.aread())
            if self.kills(body):
                self.down.add(host)
                self.killed.append(host)
                died = b'data: {"error": {"message": "EngineCore died", "code": 500}}\n\n'
                stream = _FaultyStream([died] if self.kill_with_error else [], Fault("drop_after"), request)
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=stream, request=request
                )
        if request.url.path == "/health" and host in self.hung:
            raise httpx.ReadTimeout("health check timed out", request=request)
        queue = self.faults.get(host) or []
        if request.url.path != "/v1/completions" or not queue:
            return await self.inner.handle_async_request(request)
        fault = queue.pop(0)
        if fault.kind == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_FaultyStream(events[: fault.after], fault, request),
            request=request,
        )


class _FaultyStream(httpx.AsyncByteStream):
    def __init__(self, events: list[bytes], fault: Fault, request: httpx.Request) -> None:
        self.events = events
        self.fault = fault
        self.request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
            await asyncio.sleep(0)
        if self.fault.kind == "stall_after":
            await asyncio.Event().wait()  # never set: the worker hangs
        raise httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body", request=self.request
        )


def autoregressive(context: list[int]) -> int:
    """A fake engine's next token as a function of the whole context, like greedy decoding: a request
    resumed from prompt + k generated tokens continues with exactly the same tokens."""
    return (context[-1] * 31 + len(context) * 7) % 400 + 10


def word_ids(model_dir: str) -> list[int]:
    """The ids of a model's whole-word tokens (" the", " value", ...): a fake engine that draws from
    them writes text a person can read in a dashboard or a demo."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    words = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if text.startswith(" ") and text[1:].isascii() and text[1:].isalpha() and len(text) > 2:
            words.append(i)
    return words


POLICY_ENV = "BELAYER_FAKE_POLICY"
"""Set (to anything) in the gateway's environment, its launched fake workers sample from `hashed_policy`
(``FakeEngine.policy``): keyed sampling's draws, or their own RNG's (``belayer bench determinism``)."""
POLICY_FLOOR = -1e9


def hashed_policy(context: list[int]) -> list[float]:
    """Logits over ids 0..399 that depend on the context's last 3 tokens; ids below 100 (the tiny model's
    control tokens among them) are never drawn.

    >>> logits = hashed_policy([5, 6, 7]); len(logits), logits[:100] == [POLICY_FLOOR] * 100
    (400, True)
    """
    h = zlib.crc32(json.dumps(context[-3:]).encode())
    return [POLICY_FLOOR] * 100 + [((h >> (i % 24)) % 97) / 25.0 + (i % 7) * 0.1 for i in range(100, 400)]


def autoregressive_over(vocab: list[int]) -> Callable[[list[int]], int]:
    """`autoregressive`, drawing its tokens from `vocab`."""
    return lambda context: vocab[(context[-1] * 31 + len(context) * 7) % len(vocab)]


def serve(
    host: str,
    port: int,
    model: str = "fake",
    tokens: int | None = None,
    token_delay: float = 0.0,
    max_model_len: int = 4096,
    words_from: str | None = None,
    token_delay_max: float | None = None,
    die_over: int | None = None,
    with_engine_core: bool = False,
) -> None:
    """Serve a fake engine until interrupted: `tokens` tokens per request when given (benchmarks),
    else autoregressive output up to ``max_tokens`` (launched fake workers: failover stays exact),
    drawn from the whole words of the model in `words_from` when given; each stream's delay between
    tokens is drawn from [`token_delay`, `token_delay_max`] when that is given; `with_engine_core`: with a
    stand-in engine core process (`engine_core`)."""
    import uvicorn

    if tokens is not None:
        n = tokens
        engine = FakeEngine(
            model=model, max_model_len=max_model_len, token_delay=token_delay,
            token_delay_max=token_delay_max, script=lambda prompt: [(prompt[-1] + i) % 500 + 10 for i in range(n)],
        )  # fmt: skip
    else:
        step = autoregressive_over(word_ids(words_from)) if words_from else autoregressive
        engine = FakeEngine(model=model, max_model_len=max_model_len, token_delay=token_delay, step=step)
        if os.environ.get(POLICY_ENV):
            engine.step, engine.policy = None, hashed_policy
    engine.query_of_death = seeded_over(die_over) if die_over is not None else None
    app = RequireApiKey(engine.app())  # the key a launched worker is given (core.worker_auth), if any
    core = engine_core() if with_engine_core else None
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
    finally:
        if core is not None:
            core.kill()
            core.wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m engine_pool.fake``: what ``belayer serve --worker-kind fake`` launches per worker."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m engine_pool.fake", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="fake")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=None, help="tokens per request (default: max_tokens)")
    delay = os.environ.get(
        TOKEN_DELAY_ENV
    )  # launched fake workers as fast as an engine: `belayer demo`'s test
    p.add_argument("--token-delay", type=float, default=float(delay) if delay else 0.02,
                   help=f"seconds between streamed tokens (default: ${TOKEN_DELAY_ENV}, else 0.02)")  # fmt: skip
    p.add_argument("--words-from", metavar="MODEL_DIR", help="write that model's whole-word tokens")
    die_over = os.environ.get(DIE_OVER_ENV)  # set by `belayer bench query-of-death` for its launched workers
    p.add_argument(
        "--die-on-seeded-prompts-over", type=int, metavar="TOKENS", default=int(die_over) if die_over else None,
        help=f"exit, as vLLM 0.32's engine does, on a seeded request whose prompt is over TOKENS tokens "
        f"(default: ${DIE_OVER_ENV}, else never)",
    )  # fmt: skip
    p.add_argument(
        "--engine-core", action="store_true", default=os.environ.get(ENGINE_CORE_ENV) == "1",
        help=f"run a stand-in engine core process, titled {ENGINE_CORE_TITLE} (default: ${ENGINE_CORE_ENV}=1)",
    )  # fmt: skip
    for option in ("--load-format", "--model-loader-extra-config", "--gpu-memory-utilization"):
        # vLLM's, as a pool with a weight owner passes them: a fake engine loads no weights
        p.add_argument(option, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    serve(
        args.host, args.port, args.model, args.tokens, args.token_delay, args.max_model_len, args.words_from,
        die_over=args.die_on_seeded_prompts_over, with_engine_core=args.engine_core,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
