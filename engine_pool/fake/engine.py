"""The fake engine itself (`FakeEngine`): an ASGI app that speaks the subset of vLLM's API the gateway
uses, and replays chosen token ids (``engine_pool.fake`` tells the whole story).

>>> import asyncio, httpx
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
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.keyed import choose
from engine_pool.engine.client import REQUEST_ID_HEADER, session_of_request
from engine_pool.fake.stats import FakeStats

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
