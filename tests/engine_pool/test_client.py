"""The engine client translates transport errors into the project's tree at one boundary."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from core.errors import (
    EngineProtocolError,
    EngineRejected,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
)
from core.net import free_port
from engine_pool.engine.client import EngineClient, SamplingParams
from engine_pool.fake import FakeEngine, fake_logprob
from gateway.config import GatewayConfig
from tests.support import asgi_gateway


async def collect(client: EngineClient, prompt: list[int]) -> list[int]:
    return [
        t
        for c in [c async for c in client.generate(prompt, SamplingParams(max_tokens=8, top_logprobs=1))]
        for t in c.token_ids
    ]


async def test_streams_token_ids_and_logprobs() -> None:
    engine = FakeEngine(outputs=[[5, 6, 7]])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(engine.app())) as http:
        client = EngineClient("http://e", "fake", http)
        chunks = [c async for c in client.generate([1, 2], SamplingParams(max_tokens=8, top_logprobs=2))]
    # Events that arrive in one read are merged into one chunk (ASGITransport delivers the whole body).
    ids = [t for c in chunks for t in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs]
    tops = [t for c in chunks for t in c.top_logprobs]
    assert ids == [5, 6, 7] and lps == [fake_logprob(i, t) for i, t in enumerate(ids)]
    assert tops[0][:2] == [(5, fake_logprob(0, 5)), (6, fake_logprob(0, 5) - 1)] and len(tops) == 3
    assert chunks[-1].finish_reason == "stop"
    assert engine.requests[0]["prompt"] == [1, 2] and engine.requests[0]["return_token_ids"] is True


async def test_connection_refused_is_unavailable() -> None:
    async with httpx.AsyncClient() as http:
        client = EngineClient(f"http://127.0.0.1:{free_port()}", "m", http)
        with pytest.raises(EngineUnavailable):
            await collect(client, [1])
        assert await client.health() is False


@pytest.mark.parametrize(
    ("handler", "error"),
    [
        (lambda r: httpx.Response(400, json={"error": {"message": "bad prompt"}}), EngineRejected),
        # A 5xx answer is the engine talking: a health probe, not this answer, decides about the worker.
        (lambda r: httpx.Response(503, text="overloaded"), EngineServerError),
        (lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r)), EngineTimeout),
        (
            lambda r: (_ for _ in ()).throw(httpx.RemoteProtocolError("peer closed", request=r)),
            EngineUnavailable,
        ),
        # Answers that are not the engine's protocol: an engine error (502), never a gateway 500.
        (lambda r: httpx.Response(200, text="data: {not json\n\n"), EngineProtocolError),
        (lambda r: httpx.Response(200, text='data: {"choices": "x"}\n\n'), EngineProtocolError),
        (
            lambda r: httpx.Response(200, text='data: {"choices": [{"token_ids": ["a"]}]}\n\n'),
            EngineProtocolError,
        ),
        (lambda r: httpx.Response(200, text="data: [1, 2]\n\n"), EngineProtocolError),
    ],
)
async def test_errors_are_translated(handler: object, error: type[Exception]) -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:  # type: ignore[arg-type]
        with pytest.raises(error) as e:
            await collect(EngineClient("http://e", "m", http), [1])
    if error is EngineRejected:
        assert str(e.value) == "bad prompt" and e.value.engine_status == 400  # type: ignore[attr-defined]


async def test_a_malformed_engine_stream_is_a_502_through_the_gateway(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 4096}]})
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, text="data: {broken\n\n")

    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    async with asgi_gateway(config, httpx.MockTransport(engine), hosts=["http://e"]) as (app, client):
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 502 and r.json()["error"]["code"] == "engine_protocol_error", r.text
        a = await client.post("/v1/messages", json={**body, "max_tokens": 4})
        assert a.status_code == 502 and a.json()["type"] == "error", a.text
        pool = app.state.gateway.pool
        assert [m.state for m in pool.roster.members] == ["ready"]  # not fenced for a malformed answer
