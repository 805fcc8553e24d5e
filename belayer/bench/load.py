"""The load of ``belayer bench gateway``: the paths to the engine (`Target`: direct, through a gateway,
through LiteLLM), short requests timed one at a time in a rotating order (`latencies`), and streams
counted in measurement windows at a fixed concurrency (`throughput`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from belayer.bench.proc_tree import tree_cpu_s
from belayer.testing.services import progress
from core.errors import BenchError


@dataclass(frozen=True, slots=True)
class Target:
    """One way to reach the engine: its chat URL, the model name it expects, and its API key if any."""

    name: str
    url: str
    model: str
    api_key: str | None = None
    pid: int | None = None
    """The server process behind it (a gateway's), whose CPU time (with its children's) is measured."""

    def cpu_s(self) -> float:
        return tree_cpu_s(self.pid) if self.pid is not None else 0.0

    @property
    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    def body(self, max_tokens: int, stream: bool) -> bytes:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return json.dumps(body).encode()


async def chat_once(http: httpx.AsyncClient, target: Target, body: bytes) -> float:
    """One non-streamed chat request; its latency in milliseconds."""
    t0 = time.perf_counter()
    resp = await http.post(target.url, content=body, headers=target.headers)
    elapsed = (time.perf_counter() - t0) * 1000
    if resp.status_code != 200:
        raise BenchError(f"{target.name} answered HTTP {resp.status_code}: {resp.text[:500]}")
    return elapsed


async def check_reply(http: httpx.AsyncClient, target: Target, max_tokens: int) -> None:
    resp = await http.post(target.url, content=target.body(max_tokens, False), headers=target.headers)
    if resp.status_code != 200:
        raise BenchError(f"{target.name} answered HTTP {resp.status_code}: {resp.text[:500]}")
    content = resp.json()["choices"][0]["message"]["content"]
    progress(f"{target.name} replies {content!r}")


async def latencies(
    http: httpx.AsyncClient, targets: list[Target], n: int, warmup: int, max_tokens: int
) -> dict[str, list[float]]:
    """``n`` sequential requests per target after ``warmup``, alternating targets in a rotating order."""
    bodies = {t.name: t.body(max_tokens, False) for t in targets}
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(warmup + n):
        shift = i % len(targets)
        for t in targets[shift:] + targets[:shift]:
            ms = await chat_once(http, t, bodies[t.name])
            if i >= warmup:
                out[t.name].append(ms)
    return out


@dataclass(slots=True)
class StreamTally:
    """Content chunks received (all, and inside measurement windows), and finished streams' tokens."""

    received: int = 0
    window_chunks: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0  # the server's CPU time in the windows
    tokens: int = 0  # of finished streams, from their usage
    chunks: int = 0  # of finished streams
    requests: int = 0

    @property
    def token_estimate(self) -> float:
        """Tokens received in the windows: chunks, at the finished streams' tokens per chunk."""
        return self.window_chunks * (self.tokens / self.chunks if self.chunks else 1.0)


async def stream_once(http: httpx.AsyncClient, target: Target, body: bytes, tally: StreamTally) -> None:
    """One streamed chat request: count content chunks as they come, and tokens from the final usage."""
    chunks, usage = 0, None
    async with http.stream("POST", target.url, content=body, headers=target.headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread())[:500].decode(errors="replace")
            raise BenchError(f"{target.name} answered HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise BenchError(f"{target.name} failed mid-stream: {event['error']}")
            usage = event.get("usage") or usage
            n = sum(1 for c in event.get("choices") or [] if (c.get("delta") or {}).get("content"))
            chunks += n
            tally.received += n
    tally.chunks += chunks
    tally.tokens += int(usage["completion_tokens"]) if usage else chunks
    tally.requests += 1


MAX_WINDOW_S = 30.0
"""The longest a throughput window is stretched to hold a chunk per client (a loaded machine)."""


async def stream_load(
    http: httpx.AsyncClient,
    target: Target,
    concurrency: int,
    ramp: float,
    seconds: float,
    max_tokens: int,
    tally: StreamTally,
) -> None:
    """``concurrency`` clients streaming back to back; chunks are counted for ``seconds`` after ``ramp``
    (so that every path is measured in its steady state), then the streams under way are cut off."""
    body = target.body(max_tokens, True)

    async def client() -> None:
        while True:
            await stream_once(http, target, body, tally)

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    try:
        failed, _ = await asyncio.wait(tasks, timeout=ramp, return_when=asyncio.FIRST_EXCEPTION)
        t0, before, cpu0 = time.monotonic(), tally.received, target.cpu_s()
        window = seconds
        while not failed:
            failed, _ = await asyncio.wait(tasks, timeout=window, return_when=asyncio.FIRST_EXCEPTION)
            # a window too short for a loaded machine to stream anything has no rate: it goes on, up to
            # MAX_WINDOW_S in all, until it holds a chunk per client
            if tally.received - before >= concurrency or time.monotonic() - t0 >= MAX_WINDOW_S:
                break
            window = min(seconds, MAX_WINDOW_S - (time.monotonic() - t0))
        if not failed and tally.received == before:
            raise BenchError(f"{target.name}: no chunk streamed in {MAX_WINDOW_S:.0f} s of load")
        tally.seconds += time.monotonic() - t0
        tally.cpu_s += target.cpu_s() - cpu0
        tally.window_chunks += tally.received - before
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in failed:  # a client only stops by failing
        raise t.exception() or BenchError(f"a {target.name} stream client stopped")


async def throughput(
    http: httpx.AsyncClient, targets: list[Target], opts: argparse.Namespace
) -> dict[str, StreamTally]:
    tallies = {t.name: StreamTally() for t in targets}
    for t in targets:  # run each path's streaming code once before measuring
        await stream_once(http, t, t.body(opts.stream_tokens, True), tallies[t.name])
    for r in range(opts.stream_rounds):
        shift = r % len(targets)
        for t in targets[shift:] + targets[:shift]:
            args = (opts.concurrency, opts.stream_ramp, opts.stream_seconds, opts.stream_tokens)
            await stream_load(http, t, *args, tallies[t.name])
    return tallies
