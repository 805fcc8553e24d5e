"""A gateway's engine pool as the recovery benches watch and hurt it: its engines, a wait for its
strength, a worker killed in the middle of a stream (timed to the client's next token), a cold start.
Used by ``belayer bench recovery`` and its weight-owner figures (`belayer.bench.weight_owner`). A request
made to a worker itself (a cold start's first) sends the key the bench gave the gateway (`WorkerKey`).

>>> streamed_tokens('data: {"choices": [{"logprobs": {"content": [{}, {}]}}]}'), streamed_tokens(": ping")
(2, 0)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx

from belayer.bench.stand_up import WorkerKey
from core.errors import BenchError


def streamed_tokens(line: str) -> int:
    """The tokens one line of a streamed chat completion carries (one logprob entry per token)."""
    if not line.startswith("data: {"):
        return 0
    choices = json.loads(line[6:]).get("choices") or [{}]
    return len(((choices[0].get("logprobs") or {}).get("content")) or [])


async def engines(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    """The pool as ``GET /api/engines`` shows it: each worker and shadow, its state, pid and URLs."""
    data: list[dict[str, Any]] = (await http.get(f"{url}/api/engines")).json()["data"]
    return data


async def wait_until(
    http: httpx.AsyncClient, url: str, ready: int, shadows: int, timeout: float, exclude: str = ""
) -> float:
    """When (``time.monotonic()``) the pool has `ready` ready workers and `shadows` shadows, not counting
    `exclude`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        states = [e["state"] for e in await engines(http, url) if e["name"] != exclude]
        if states.count("ready") >= ready and states.count("shadow") >= shadows:
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise BenchError(f"the pool did not reach {ready} ready + {shadows} shadow workers in {timeout:.0f}s")


async def kill_once(url: str, opts: argparse.Namespace, key: WorkerKey) -> dict[str, float]:
    """Stream a long greedy reply, SIGKILL its worker after a few tokens, and time the recovery.

    Tokens are counted exactly (the stream carries one logprob entry per token), so the client's first
    token generated *after* the failover is known from the trajectory's failover event. `key`: the one the
    gateway at `url` gave its workers (the cold start's request goes to the replacement itself)."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await wait_until(http, url, opts.workers, opts.shadows, 900)
        sid = (await http.post(f"{url}/api/sessions", json={})).json()["id"]
        body = {"model": "policy", "messages": [{"role": "user", "content": "count"}], "temperature": 0,
                "max_tokens": opts.kill_after + 400, "stream": True, "logprobs": True}  # fmt: skip
        arrivals: list[float] = []  # arrival time of each token at the client
        t_kill = 0.0
        async with http.stream("POST", f"{url}/s/{sid}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                arrivals += [time.monotonic()] * streamed_tokens(line)
                if not t_kill and len(arrivals) >= opts.kill_after:
                    victim = next(e for e in await engines(http, url) if e["outstanding"] > 0)
                    t_kill = time.monotonic()
                    os.killpg(victim["pid"], signal.SIGKILL)
                    # polled alongside the stream: the pool is back at its configured ready count when?
                    restored = asyncio.create_task(
                        wait_until(http, url, opts.workers, 0, 600, exclude=victim["name"])
                    )
                    full_task = asyncio.create_task(  # polled alongside too: not bounded by the stream's end
                        wait_until(http, url, opts.workers, opts.shadows, 900, exclude=victim["name"])
                    )
        capacity = await restored - t_kill
        events = (await http.get(f"{url}/api/sessions/{sid}/trajectory")).json()["events"]
        [failover] = [e["data"] for e in events if e["kind"] == "failover"]
        failover_s = arrivals[failover["token_index"]] - t_kill  # the first resumed token
        full = await full_task - t_kill
        cold = await cold_start(http, url, key)
        return {
            "failover_s": failover_s,
            "capacity_restored_s": capacity,
            "full_strength_s": full,
            "cold_start_s": cold,
        }


async def cold_start(http: httpx.AsyncClient, url: str, key: WorkerKey) -> float:
    """The newest worker (the replacement just launched): process start → ready, plus its first (cold)
    request's first token (sent with `key`, which the worker asks)."""
    newest = max(await engines(http, url), key=lambda e: e["launched_at"] or 0)
    t0 = time.monotonic()
    body = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    (await http.post(f"{newest['url']}/v1/completions", json=body, headers=key.headers)).raise_for_status()
    return float(newest["ready_at"] - newest["launched_at"] + time.monotonic() - t0)
