"""The gateway's engine transports (`engine_pool.engine.transport`: httptools on asyncio protocols for plain
HTTP, and httpx over asyncio streams and a linear-time pool for the rest) against a real engine process
over TCP: the same tokens as httpx's own transport, connections reused, and the same errors where the
engine fails (what failover relies on)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from core.errors import EngineTimeout, EngineUnavailable
from engine_pool.engine.client import EngineClient, SamplingParams
from engine_pool.engine.transport import engine_transport, httpx_transport
from engine_pool.fake import FakeEngine, autoregressive
from tests.support import held_engine

LIMITS = httpx.Limits(max_connections=64, max_keepalive_connections=8)
TRANSPORTS = {"engine": engine_transport, "httpx": httpx_transport}
PROMPT = [5, 6, 7]


async def _tokens(engine: EngineClient, max_tokens: int, stream: bool = True) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [t async for c in engine.generate(PROMPT, params, stream=stream) for t in c.token_ids]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_streams_the_same_tokens_as_httpx_and_reuses_connections(tmp_path: Path, name: str) -> None:
    expected = FakeEngine(step=autoregressive).greedy(PROMPT, 40)

    async def run(url: str) -> None:
        transport = TRANSPORTS[name](LIMITS)
        async with httpx.AsyncClient(transport=transport, timeout=None) as http:
            engine = EngineClient(url, "fake", http)
            results = await asyncio.gather(*(_tokens(engine, 40) for _ in range(16)))
            assert results == [expected] * 16
            assert await _tokens(engine, 40, stream=False) == expected
            for _ in range(5):  # one after another: one connection, kept alive
                assert await _tokens(engine, 3) == expected[:3]
            pool = transport._pool  # type: ignore[attr-defined]
            assert 1 <= len(pool.connections) <= 8  # LIMITS.max_keepalive_connections
        async with httpx.AsyncClient(limits=LIMITS, timeout=None) as http:  # httpx's own, for reference
            assert await _tokens(EngineClient(url, "fake", http), 40) == expected

    with held_engine(tmp_path, 0.0, require_exit=False) as (url, _):
        asyncio.run(run(url))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_engine_errors_are_translated_as_with_httpx(tmp_path: Path, name: str) -> None:
    async def run(url: str, pid: int) -> None:
        async with httpx.AsyncClient(transport=TRANSPORTS[name](LIMITS), timeout=None) as http:
            slow = EngineClient(url, "fake", http, read_timeout=0.05)
            # 0.2 s between tokens: a stall. 50 tokens, so that a client paused for a while (a loaded
            # machine) and then reading buffered tokens still meets a 0.2 s gap before the end.
            with pytest.raises(EngineTimeout):
                await _tokens(slow, 50)
            engine = EngineClient(url, "fake", http)
            got: list[int] = []
            with pytest.raises(EngineUnavailable):  # kill -9 mid-stream
                async for chunk in engine.generate(PROMPT, SamplingParams(max_tokens=50)):
                    got += chunk.token_ids
                    os.kill(pid, signal.SIGKILL)
            assert got == FakeEngine(step=autoregressive).greedy(PROMPT, 1)
            with pytest.raises(EngineUnavailable):  # nothing listens any more
                await _tokens(engine, 5)
            assert not await engine.health()

    with held_engine(tmp_path, 0.2, require_exit=False) as (url, pid):
        asyncio.run(run(url, pid))
