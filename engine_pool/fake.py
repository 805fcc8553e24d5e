"""A scripted fake vLLM engine (ASGI): replays chosen token ids, for unit tests and gateway benchmarks.

It speaks the subset of vLLM's API the gateway uses: ``/v1/completions`` with token-id prompts,
``return_token_ids``, ``return_tokens_as_token_ids`` and ``logprobs`` (streamed or not), ``/v1/models``
and ``/health``. Logprobs are a deterministic function of position and token id.

Example::

    engine = FakeEngine(outputs=[[11, 12, 2]])      # the next request gets tokens 11, 12, 2
    http = httpx.AsyncClient(transport=httpx.ASGITransport(engine.app()))
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

Script = Callable[[list[int]], list[int]]


def fake_logprob(position: int, token_id: int) -> float:
    return -0.25 - 0.01 * position - token_id * 1e-5


@dataclass(slots=True)
class FakeEngine:
    """``outputs`` are served in order, one per request; ``script`` is used once they run out."""

    outputs: list[list[int]] = field(default_factory=list)
    script: Script | None = None
    model: str = "fake"
    max_model_len: int = 4096
    token_delay: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)

    def next_output(self, prompt: list[int]) -> list[int]:
        if self.outputs:
            return self.outputs.pop(0)
        if self.script is not None:
            return self.script(prompt)
        return [(prompt[-1] * 31 + i * 7) % 200 + 10 for i in range(8)] if prompt else [10]

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
            ]
        )

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        card = {"id": self.model, "object": "model", "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return JSONResponse({"error": {"message": "fake engine takes token-id prompts"}}, status_code=400)
        if len(prompt) + int(body.get("max_tokens") or 0) > self.max_model_len:
            msg = f"This model's maximum context length is {self.max_model_len} tokens."
            return JSONResponse({"error": {"message": msg, "type": "BadRequestError"}}, status_code=400)
        out = self.next_output(prompt)
        max_tokens = int(body.get("max_tokens") or len(out))
        finish = "length" if len(out) > max_tokens else "stop"
        out = out[:max_tokens]
        k = body.get("logprobs")
        if body.get("stream"):
            return StreamingResponse(self._stream(out, k, finish), media_type="text/event-stream")
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
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps, "top_logprobs": tops}
        return choice

    async def _stream(self, out: list[int], k: int | None, finish: str) -> AsyncIterator[str]:
        for i, tid in enumerate(out):
            if self.token_delay:
                await asyncio.sleep(self.token_delay)
            last = i == len(out) - 1
            event = {"object": "text_completion", "model": self.model, "choices": [self._choice([tid], i, k, finish if last else None)]}
            yield f"data: {json.dumps(event)}\n\n"
        if not out:
            event = {"object": "text_completion", "choices": [self._choice([], 0, k, finish)]}
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
