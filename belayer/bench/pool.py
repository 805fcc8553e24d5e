"""A gateway's engine pool as the recovery benches watch and hurt it: its engines, a wait for its
strength, a worker killed in the middle of a stream (timed to the client's next token), a cold start.
The failover event's clock times (``noticed_at``...) say where a failover's time went, from the kill
(`loss_timeline`). Used by ``belayer bench recovery`` and its weight-owner figures (`belayer.bench.weight_owner`). A request
made to a worker itself (a cold start's first) sends the key the bench gave the gateway (`WorkerKey`).

>>> streamed_tokens('data: {"choices": [{"logprobs": {"content": [{}, {}]}}]}'), streamed_tokens(": ping")
(2, 0)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import select
import signal
import threading
import time
from typing import Any

import httpx

from belayer.bench.stand_up import WorkerKey
from belayer.bench.waits import failure, found, until
from core.errors import BenchError
from engine_pool.workers.exits import group


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
    http: httpx.AsyncClient, url: str, ready: int, shadows: int, timeout: float, exclude: str = "",
    interval: float = 0.02,
) -> float:  # fmt: skip
    """When (``time.monotonic()``) the pool has `ready` ready workers and `shadows` shadows, not counting
    `exclude` (looked at every `interval` seconds)."""

    async def reached() -> float | None:
        states = [e["state"] for e in await engines(http, url) if e["name"] != exclude]
        return (
            time.monotonic() if states.count("ready") >= ready and states.count("shadow") >= shadows else None
        )

    what = f"the pool to have {ready} ready + {shadows} shadow workers"
    return await found(reached, what, timeout, interval=interval)


def reached_at(pool: list[dict[str, Any]], state: str, count: int, since: float) -> float:
    """When (``time.time()``, the pool's clock for its members' transitions) `count` of the `pool`'s
    members (``GET /api/engines``) were in `state`: those in it before `since` count from then, the others
    from their last transition (into it).

    >>> pool = [{"state": "ready", "last_transition": {"at": 5.0}}, {"state": "ready"},
    ...         {"state": "shadow", "last_transition": {"at": 30.0}}]
    >>> reached_at(pool, "ready", 1, 4.0), reached_at(pool, "ready", 2, 4.0), reached_at(pool, "shadow", 0, 4.0)
    (4.0, 5.0, 4.0)
    """
    if count == 0:
        return since
    times = sorted(
        max(since, float(t["at"])) if (t := e.get("last_transition")) else since
        for e in pool
        if e["state"] == state
    )
    if len(times) < count:
        raise BenchError(f"the pool has {len(times)} members {state}, not {count}")
    return times[count - 1]


async def busy_worker(http: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    """A live worker with a request outstanding (the one serving a bench's only stream), or None."""
    return next((e for e in await engines(http, url) if e["state"] != "dead" and e["outstanding"] > 0), None)


def ended(stream: asyncio.Task[Any], tokens: list[float]) -> str | None:
    """Why waiting on the running `stream` (`tokens`: its arrivals so far) is hopeless, if it is."""
    if not stream.done():
        return None
    return failure([stream]) or f"the stream ended after {len(tokens)} tokens"


async def serving_worker(
    http: httpx.AsyncClient, url: str, stream: asyncio.Task[Any], arrivals: list[float], after: int
) -> dict[str, Any]:
    """The worker serving `stream` (the only one running), once its client has `after` tokens (their
    `arrivals`): waited for with deadlines while the stream goes on; a `BenchError` that says which wait
    gave up, and why when the stream ended (or failed) first."""

    def hopeless() -> str | None:
        return ended(stream, arrivals)

    await until(lambda: len(arrivals) >= after, f"the stream's first {after} tokens", 300, hopeless=hopeless)
    return await found(
        lambda: busy_worker(http, url), "a worker with the stream outstanding", 60, hopeless=hopeless
    )


async def _stream(http: httpx.AsyncClient, url: str, body: dict[str, Any], arrivals: list[float]) -> None:
    async with http.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            arrivals += [time.monotonic()] * streamed_tokens(line)


class Teardown:
    """When a killed process group's memory is freed: a thread waits on a pidfd of each of its processes,
    which turns readable when the process has exited, its memory freed (without polling: the bench must
    not take the CPUs the failover it times needs). ``ms``: after the kill (`start`), or None if any
    was still exiting 30 s later."""

    def __init__(self, pgid: int) -> None:
        self.fds = []
        for pid, _, _ in group(pgid):
            with contextlib.suppress(ProcessLookupError):
                self.fds.append(os.pidfd_open(pid))
        self.ms: float | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self, t_kill: float) -> None:
        self.t_kill = t_kill
        self._thread.start()

    def _watch(self) -> None:
        waiting, deadline = list(self.fds), time.monotonic() + 30
        try:
            while waiting and (left := deadline - time.monotonic()) > 0:
                readable, _, _ = select.select(waiting, [], [], left)
                waiting = [fd for fd in waiting if fd not in readable]
            if not waiting:
                self.ms = (time.monotonic() - self.t_kill) * 1000
        finally:
            for fd in self.fds:
                os.close(fd)


async def kill_once(url: str, opts: argparse.Namespace, key: WorkerKey) -> dict[str, float]:
    """Stream a long greedy reply, SIGKILL its worker after ``--kill-after`` tokens, and time the recovery.

    Tokens are counted exactly (the stream carries one logprob entry per token), so the client's first
    token generated *after* the failover is known from the trajectory's failover event. The worker killed
    is the one the pool shows with the request outstanding, waited for (with a deadline) while the stream
    goes on: an engine that already finished the reply has no request left to kill. `key`: the one the
    gateway at `url` gave its workers (the cold start's request goes to the replacement itself)."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await wait_until(http, url, opts.workers, opts.shadows, 900)
        created = await http.post(f"{url}/api/sessions", json={})
        created.raise_for_status()
        sid = created.json()["id"]
        body = {"model": "policy", "messages": [{"role": "user", "content": "count"}], "temperature": 0,
                "max_tokens": opts.kill_after + opts.reply_tokens, "stream": True, "logprobs": True}  # fmt: skip
        arrivals: list[float] = []  # arrival time of each token at the client
        stream = asyncio.create_task(_stream(http, f"{url}/s/{sid}/v1/chat/completions", body, arrivals))
        try:
            victim = await serving_worker(http, url, stream, arrivals, opts.kill_after)
            teardown = Teardown(victim["pid"])
            t_kill, wall_kill = time.monotonic(), time.time()
            os.killpg(victim["pid"], signal.SIGKILL)
            teardown.start(t_kill)
            await stream
        finally:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)
        # nothing polls the gateway while the stream resumes (it would take the CPUs the failover needs):
        # when the pool was back at its ready count (a shadow promoted), and at full strength (the
        # replacement ready), is read afterwards from its members' own transition times
        await wait_until(http, url, opts.workers, opts.shadows, 900, exclude=victim["name"], interval=0.25)
        pool = [e for e in await engines(http, url) if e["name"] != victim["name"]]
        capacity = reached_at(pool, "ready", opts.workers, wall_kill) - wall_kill
        full = max(capacity, reached_at(pool, "shadow", opts.shadows, wall_kill) - wall_kill)
        events = (await http.get(f"{url}/api/sessions/{sid}/trajectory")).json()["events"]
        failovers = [e["data"] for e in events if e["kind"] == "failover"]
        if len(failovers) != 1:
            raise BenchError(
                f"killing {victim['name']} after {opts.kill_after} tokens gave {len(failovers)} failovers, "
                f"not 1 (its engine may have finished the {len(arrivals)}-token reply first: raise --reply-tokens)"
            )
        failover_s = arrivals[failovers[0]["token_index"]] - t_kill  # the first resumed token
        cold = await cold_start(http, url, key)
        return {
            "failover_s": failover_s,
            "capacity_restored_s": capacity,
            "full_strength_s": full,
            "cold_start_s": cold,
            **loss_timeline(failovers[0], t_kill, failover_s),
            "teardown_ms": teardown.ms if teardown.ms is not None else math.nan,
        }


def loss_timeline(event: dict[str, Any], t_kill: float, failover_s: float) -> dict[str, float]:
    """Where a failover's time went, in milliseconds from the kill (at `t_kill`, ``time.monotonic()``):
    the gateway noticed the loss (``detect``), resubmitted the turn to its new worker (``resubmitted``),
    had that worker's first token (``new_worker_token``), and the client had it (``lost``:
    `failover_s`). The failover event's times are the gateway's ``time.monotonic()``, the clock
    (``CLOCK_MONOTONIC``) every process of the host shares.

    >>> loss_timeline({"noticed_at": 10.002, "resubmitted_at": 10.003, "resumed_at": 10.02}, 10.0, 0.021)
    {'detect_ms': 2.0, 'resubmitted_ms': 3.0, 'new_worker_token_ms': 20.0, 'lost_ms': 21.0}
    """
    ms = {
        "detect_ms": event["noticed_at"],
        "resubmitted_ms": event["resubmitted_at"],
        "new_worker_token_ms": event["resumed_at"],
    }
    return {
        **{k: round((v - t_kill) * 1000, 3) for k, v in ms.items()},
        "lost_ms": round(failover_s * 1000, 3),
    }


async def cold_start(http: httpx.AsyncClient, url: str, key: WorkerKey) -> float:
    """The newest worker (the replacement just launched): process start → ready, plus its first (cold)
    request's first token (sent with `key`, which the worker asks)."""
    newest = max(await engines(http, url), key=lambda e: e["launched_at"] or 0)
    t0 = time.monotonic()
    body = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    (await http.post(f"{newest['url']}/v1/completions", json=body, headers=key.headers)).raise_for_status()
    return float(newest["ready_at"] - newest["launched_at"] + time.monotonic() - t0)
