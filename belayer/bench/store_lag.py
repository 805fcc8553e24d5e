"""``belayer bench store-lag``: the gateway's event-loop lag on PostgreSQL during a failover storm, with
the store's writes through its front (`store.front`: off the loop, in order per session) and as main
wrote them before it (a turn's events and a failed turn's end committed on the event loop).

One gateway process (in-process, over ``httpx.ASGITransport``) on a PostgreSQL store, its pool three
fake engines behind a fault injector that cuts every generation request after ``--cut-after`` tokens:
``--streams`` streaming chat requests at once, ``--rounds`` times, each turn failing over about
``--tokens / --cut-after`` times, so every cut writes a ``failover`` event while all streams run. A probe
on the event loop sleeps ``--probe-ms`` and records how late it wakes: every stream of the process
waits as long. Both paths run in the same process, ``loop`` first, each on a database of its own (``auto``) or both on
the given one.

Figures (``name: value`` lines), per path (``loop_*``, ``front_*``): ``lag_p50_ms``, ``lag_p99_ms``,
``lag_max_ms`` of the probe, ``failover_events`` written, ``turns_complete`` and ``storm_s``; then
``lag_p99_ratio`` (loop / front).

Example::

    belayer bench store-lag --postgres auto --streams 48 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import psycopg

from belayer.bench import emit
from belayer.testing.services import progress
from engine_pool.fake import FakeEngine, Fault, FaultInjector
from engine_pool.pool import EnginePool, PoolSettings
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig, QuarantineConfig
from store.front import WriteFront

HOSTS = ("e0", "e1", "e2")
DEFAULT_MODEL_DIR = ".cache/tiny-model"


class LoopPosts(WriteFront):
    """The path before the front: a posted write (an event, a failed turn's end) commits on the caller's
    thread, the event loop; awaited writes (a turn's start and end) still leave it."""

    def post(self, key: str, work: Callable[..., object], *args: Any) -> None:
        work(*args)


@contextlib.asynccontextmanager
async def gateway(
    opts: argparse.Namespace, url: str, faults: FaultInjector
) -> AsyncIterator[httpx.AsyncClient]:
    """A gateway on `url` over the fault injector's fake engines, its lifespan running; a client to it."""
    config = GatewayConfig(
        model=opts.model,
        store_path=url,
        # every request is cut again and again: not a query of death, which would be refused
        failover=FailoverConfig(
            max_failovers=opts.tokens, no_worker_wait=30.0, quarantine=QuarantineConfig(enabled=False)
        ),
        metrics=False,
    )
    async with httpx.AsyncClient(transport=faults, timeout=30.0) as engine_http:
        pool = EnginePool(engine_http, PoolSettings(probe_interval=0.05, probe_timeout=0.5))
        for host in HOSTS:
            pool.add_remote(f"http://{host}")
        app = build_app(config, pool=pool)
        transport = httpx.ASGITransport(app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60.0) as client,
        ):
            if opts.path == "loop":
                store = app.state.gateway.store
                store.front.close()
                store.front = LoopPosts(lanes=8)
            yield client


async def probe(stop: asyncio.Event, sleep_s: float, lags: list[float]) -> None:
    """How late a sleep of `sleep_s` on the loop wakes, again and again until `stop`."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(sleep_s)
        lags.append(time.perf_counter() - t0 - sleep_s)


async def storm(opts: argparse.Namespace, url: str) -> dict[str, float]:
    engine = FakeEngine(
        max_model_len=4096, token_delay=opts.token_delay, step=lambda c: (sum(c[-2:]) % 500) + 20
    )
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    cuts = opts.streams * opts.rounds * (opts.tokens // opts.cut_after + 2)
    faults.faults = {host: [Fault("drop_after", opts.cut_after)] * cuts for host in HOSTS}
    body = {
        "model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": opts.tokens,
        "stream": True,
    }  # fmt: skip
    complete = 0
    async with gateway(opts, url, faults) as client:
        before = failover_events(url)  # the store made its tables: a database given may hold some

        async def one() -> bool:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                text = "".join([chunk async for chunk in r.aiter_text()])
            return r.status_code == 200 and "[DONE]" in text

        lags: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(probe(stop, opts.probe_ms / 1000, lags))
        t0 = time.perf_counter()
        for _ in range(opts.rounds):
            complete += sum(await asyncio.gather(*(one() for _ in range(opts.streams))))
        seconds = time.perf_counter() - t0
        stop.set()
        await sampler
    cut = sorted(lags)
    return {
        "lag_p50_ms": statistics.median(cut) * 1000,
        "lag_p99_ms": cut[min(len(cut) - 1, int(len(cut) * 0.99))] * 1000,
        "lag_max_ms": cut[-1] * 1000,
        "failover_events": float(failover_events(url) - before),
        "turns_complete": float(complete),
        "storm_s": seconds,
    }


def failover_events(url: str) -> int:
    """The ``failover`` events stored in the database at `url`."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT COUNT(*) FROM events WHERE kind = 'failover'").fetchone()
    return int(row[0]) if row else 0


@contextlib.contextmanager
def databases(url: str) -> Iterator[Callable[[], str]]:
    """A new database per call: on a throwaway local server (``auto``), else `url` itself each time."""
    if url != "auto":
        yield lambda: url
        return
    from belayer.testing.postgres_local import postgres_server

    with postgres_server(durable=True) as server:
        yield server.new_database


def run(opts: argparse.Namespace) -> None:
    results: dict[str, dict[str, float]] = {}
    with databases(opts.postgres) as new_database:
        for path in ("loop", "front"):
            progress(f"store-lag: {path}: {opts.rounds} rounds of {opts.streams} streams")
            opts.path = path
            results[path] = asyncio.run(storm(opts, new_database()))
    for path, figures in results.items():
        for name, value in figures.items():
            emit(f"{path}_{name}", int(value) if name in ("failover_events", "turns_complete") else value)
    front_p99 = results["front"]["lag_p99_ms"]
    emit("lag_p99_ratio", results["loop"]["lag_p99_ms"] / front_p99 if front_p99 > 0 else float("inf"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="belayer bench store-lag", description=__doc__.split("\n")[0])
    p.add_argument(
        "--postgres", default="auto", metavar="URL", help="the database (auto: a throwaway local server)"
    )
    p.add_argument("--model", default=DEFAULT_MODEL_DIR, help="the gateway's (tokenizer's) model directory")
    p.add_argument("--streams", type=int, default=48, help="streams at once")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24, help="max_tokens of each request")
    p.add_argument(
        "--cut-after", type=int, default=4, help="every generation request is cut after this many tokens"
    )
    p.add_argument(
        "--token-delay", type=float, default=0.002, help="the fake engines' seconds between tokens"
    )
    p.add_argument("--probe-ms", type=float, default=5.0, help="the loop probe's sleep")
    opts = p.parse_args(argv)
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
