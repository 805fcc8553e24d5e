"""``belayer bench scale``'s load generator: client processes (`client_process`), each running its share
of the sessions (`Plan`) as harnesses do, one client and keep-alive connection per session, streamed
turns with tool pauses between them, and measuring what it sees (`Tally`) and its own event-loop lag."""

from __future__ import annotations

import asyncio
import contextlib
import random
import resource
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from belayer.testing.services import FAKE_MODEL, SERVED_MODEL
from core.errors import BenchError
from engine_pool.engine.http11 import Http11Transport

FD_MARGIN = 256
"""Descriptors beyond one per session that a client process keeps for itself."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What one client process runs: `sessions` through the gateway at `gateway`, `direct` ones at the
    engine at `engine`, each starting at a random moment of the ramp (from `start_at`, wall clock)."""

    gateway: str
    engine: str
    sessions: int
    direct: int
    turns: int
    tokens: int
    pause: tuple[float, float]
    ramp_s: float
    start_at: float
    seed: int
    timeout_s: float


@dataclass(slots=True)
class Tally:
    """What one client process measured (sent back to the bench as plain lists)."""

    ttft_gateway: list[float] = field(default_factory=list)
    ttft_direct: list[float] = field(default_factory=list)
    errors: int = 0
    direct_errors: int = 0
    """Failed direct sessions: the baseline's (the fake engine's), not the gateway's."""
    first_errors: list[str] = field(default_factory=list)
    turns: int = 0
    loop_lag: list[float] = field(default_factory=list)

    def failed(self, what: str, direct: bool) -> None:
        if direct:
            self.direct_errors += 1
        else:
            self.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(what)


def raise_fd_limit(needed: int) -> int:
    """The soft open-file limit raised to `needed` (up to the hard limit); a BenchError if it cannot hold
    `needed` descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise BenchError(
            f"{needed} open files are needed, the hard limit is {hard}: raise it (`ulimit -Hn`, "
            "/etc/security/limits.conf) or use more --clients"
        )
    return soft


def client_process(plan: Plan) -> dict[str, Any]:
    """Run one client process's sessions (in a process of its own); what it measured."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the bench stops it
    raise_fd_limit(plan.sessions + plan.direct + FD_MARGIN)
    tally = Tally()
    asyncio.run(run_clients(plan, tally))
    return {
        "ttft_gateway": tally.ttft_gateway, "ttft_direct": tally.ttft_direct, "errors": tally.errors,
        "direct_errors": tally.direct_errors,
        "first_errors": tally.first_errors, "turns": tally.turns, "loop_lag": tally.loop_lag,
    }  # fmt: skip


async def run_clients(plan: Plan, tally: Tally) -> None:
    rng = random.Random(plan.seed)
    fallback = httpx.AsyncHTTPTransport()  # never used: every URL here is plain http://
    sampler = asyncio.create_task(_sample_lag(tally.loop_lag))
    await asyncio.sleep(max(0.0, plan.start_at - time.time()))
    sessions = [
        _session(plan, tally, fallback, direct=i < plan.direct, delay=rng.uniform(0, plan.ramp_s),
                 rng=random.Random(rng.random()))
        for i in range(plan.sessions + plan.direct)
    ]  # fmt: skip
    try:
        await asyncio.gather(*sessions)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        await fallback.aclose()


async def _sample_lag(out: list[float], interval_s: float = 0.1) -> None:
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(interval_s)
        out.append(loop.time() - t0 - interval_s)


async def _session(
    plan: Plan,
    tally: Tally,
    fallback: httpx.AsyncBaseTransport,
    *,
    direct: bool,
    delay: float,
    rng: random.Random,
) -> None:
    """One harness: its own client and keep-alive connection, `plan.turns` streamed turns with tool
    pauses between them; a failure ends the session and is counted once."""
    await asyncio.sleep(delay)
    # Idle connections close after 5 s, as httpx's (and the OpenAI SDK's) do: a tool pause longer than
    # that reconnects. The engine's uvicorn closes idle ones after 5 s itself, so a direct session closes
    # them sooner, or a request may cross the server's close (the baseline's error, not the gateway's).
    limits = httpx.Limits(
        max_connections=1, max_keepalive_connections=1, keepalive_expiry=2.0 if direct else 5.0
    )
    transport = Http11Transport(limits, fallback)
    timeout = httpx.Timeout(plan.timeout_s)
    async with httpx.AsyncClient(transport=transport, timeout=timeout, trust_env=False) as http:
        try:
            async with asyncio.timeout(plan.timeout_s * (plan.turns + 2)):
                await _turns(http, plan, tally, direct, rng)
        except Exception as exc:  # every failure is the news: counted, the first few kept
            where = "direct" if direct else "gateway"
            tally.failed(f"{where}: {type(exc).__name__}: {str(exc)[:300]}", direct)


async def _turns(http: httpx.AsyncClient, plan: Plan, tally: Tally, direct: bool, rng: random.Random) -> None:
    if direct:
        chat, model, session = f"{plan.engine}/v1/chat/completions", FAKE_MODEL, None
    else:
        resp = await http.post(f"{plan.gateway}/api/sessions", json={})
        _check(resp.status_code, resp.content)
        session = resp.json()["id"]
        chat, model = f"{resp.json()['base_url']}/chat/completions", SERVED_MODEL
    messages: list[dict[str, str]] = [{"role": "user", "content": "Fix the failing test in the repository."}]
    for turn in range(plan.turns):
        if turn:
            await asyncio.sleep(rng.uniform(*plan.pause))  # the tool runs
        body = orjson.dumps({
            "model": model, "messages": messages, "max_tokens": plan.tokens, "temperature": 0.0,
            "stream": True,
        })  # fmt: skip
        ttft, reply = await _stream(http, chat, body)
        (tally.ttft_direct if direct else tally.ttft_gateway).append(ttft)
        tally.turns += 1
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"tool output {turn}"},
        ]
    if session is not None:
        resp = await http.post(f"{plan.gateway}/api/sessions/{session}/close", json={})
        _check(resp.status_code, resp.content)


async def _stream(http: httpx.AsyncClient, url: str, body: bytes) -> tuple[float, str]:
    """One streamed chat turn: its time to the first content, and its text."""
    t0 = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    headers = {"content-type": "application/json"}
    async with http.stream("POST", url, content=body, headers=headers) as resp:
        if resp.status_code != 200:
            _check(resp.status_code, await resp.aread())
        done, buffer = False, b""
        async for chunk in resp.aiter_bytes():
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    continue
                event = orjson.loads(line[6:])
                if "error" in event:
                    raise BenchError(f"failed mid-stream: {event['error']}")
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(text)
    if not done or ttft is None:
        raise BenchError(f"stream ended without [DONE] or content ({len(parts)} parts)")
    return ttft, "".join(parts)


def _check(status: int, content: bytes) -> None:
    if not 200 <= status < 300:
        raise BenchError(f"HTTP {status}: {content[:300].decode(errors='replace')}")
