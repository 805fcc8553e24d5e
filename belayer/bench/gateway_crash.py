"""``belayer bench gateway-crash``: a gateway killed with SIGKILL under streaming sessions, restarted
(or, with ``--replicas 2``, left dead behind a load balancer while another replica takes over).

In one run:

* the cost of writing running turns' tokens while they stream (``[inflight]``): streamed tokens/s
  through a gateway with it on and one with it off, in alternating rounds, in front of the same fast
  fake engine (``inflight_flush_overhead_ratio``: the fraction of throughput it costs; 0 is free);
* ``--sessions`` sessions each finish a first turn, then stream a long greedy reply; once every stream
  has ``--kill-after`` tokens, the gateway process is killed (``kill -9``, by its PID) and restarted
  on the same port and store, and each client retries its request (as the SDKs do) until it streams:
  - ``sessions_continued_pct``: sessions whose retry is a new turn with exactly the interrupted turn's
    prompt ids, built by prefix reuse of the first turn, and whose reply starts with the tokens the
    interrupted turn kept;
  - ``turns_lost``: turns begun before the kill that the restarted gateway's store lacks, or holds as
    neither complete nor interrupted;
  - ``tokens_kept_pct``: of the tokens the clients had received at the kill, the share the store kept;
  - ``first_token_after_crash_s``: the kill → each client's first token of its retry (median; max too),
    gateway restart included.
* with ``--replicas 2`` (and ``--store postgresql://...``, or ``--postgres auto``: a throwaway local
  server, `belayer.testing.postgres_local`), the same again behind a load balancer, in the same run: two
  ``belayer serve`` replicas share the PostgreSQL store behind Debian's HAProxy (everything to replica A
  while it is up), A is killed with ``kill -9`` under the same streams and is *not* restarted, and the
  clients' retries go through the balancer to B, which finds each session in the store and marks A's
  running turns interrupted (at the retry's turn, or at its periodic sweep). The same four figures,
  prefixed ``replicas_`` (``replicas_sessions_continued_pct``, ``replicas_turns_lost``,
  ``replicas_tokens_kept_pct``, ``replicas_first_token_after_crash_s``), next to the restart's.

Figures are printed as ``name: value`` lines; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.gateway import streaming_rates
from belayer.bench.pool import streamed_tokens
from belayer.bench.stand_up import ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.bench.waits import failure, until
from belayer.testing.services import (
    Service,
    base_url,
    haproxy_service,
    progress,
    running,
)
from core.errors import BenchError
from core.net import free_port


def _gateway(
    workdir: Path,
    name: str,
    model: str,
    engine: str,
    port: int,
    inflight: bool = True,
    store: str | None = None,
) -> Service:
    """A ``belayer serve`` on `port`: its own SQLite file, or the PostgreSQL `store` replicas share."""
    env: dict[str, str | None] = {"BELAYER_INFLIGHT__ENABLED": "true" if inflight else "false"}
    return serve_service(workdir, name, model, ["--engine-url", engine], port=port, store=store, env=env)


def overhead(workdir: Path, opts: argparse.Namespace) -> None:
    def gateways(engine: str) -> list[Service]:
        return [_gateway(workdir, "inflight-on", opts.model, engine, free_port()),
                _gateway(workdir, "inflight-off", opts.model, engine, free_port(), inflight=False)]  # fmt: skip

    rates = streaming_rates(workdir, opts, gateways)
    on, off = rates["inflight-on"], rates["inflight-off"]
    emit("stream_tokens_per_s_inflight_on", on)
    emit("stream_tokens_per_s_inflight_off", off)
    emit("inflight_flush_overhead_ratio", (off - on) / off)


@dataclass(slots=True)
class _Session:
    sid: str = ""
    received: int = 0
    """Tokens of the long reply received before the kill."""
    first_after_crash: float | None = None
    retries: int = 0


async def _session(
    http: httpx.AsyncClient, url: str, s: _Session, killed: asyncio.Event, opts: argparse.Namespace
) -> None:
    created = await http.post(f"{url}/api/sessions", json={})
    created.raise_for_status()
    s.sid = created.json()["id"]
    chat = f"{url}/s/{s.sid}/v1/chat/completions"
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"session {s.sid[-6:]}"}]
    first = await http.post(
        chat, json={"model": "policy", "messages": messages, "max_tokens": 8, "temperature": 0}
    )
    first.raise_for_status()
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
    body = {"model": "policy", "messages": messages, "max_tokens": opts.reply_tokens, "temperature": 0,
            "stream": True, "logprobs": True}  # fmt: skip
    try:
        async with http.stream("POST", chat, json=body) as r:
            async for line in r.aiter_lines():
                if not killed.is_set():
                    s.received += streamed_tokens(line)
    except httpx.HTTPError:
        pass  # the gateway died: retry below
    else:
        raise BenchError(f"session {s.sid}: the stream ended before the kill (raise --reply-tokens)")
    deadline = time.monotonic() + opts.retry_deadline
    while time.monotonic() < deadline:  # the harness retries the same request, as the SDKs do
        s.retries += 1
        try:
            async with http.stream("POST", chat, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.05)
                    continue
                async for line in r.aiter_lines():
                    if s.first_after_crash is None and streamed_tokens(line):
                        s.first_after_crash = time.monotonic()
                return
        except httpx.HTTPError:
            await asyncio.sleep(0.05)  # the gateway is not back yet
    raise BenchError(f"session {s.sid}: no retry succeeded within {opts.retry_deadline:.0f} s")


def _continued(traj: dict[str, Any]) -> tuple[bool, int]:
    """Whether the session continued after the crash, and the tokens its interrupted turn kept."""
    turns = traj["turns"]
    if len(turns) != 3 or [t["status"] for t in turns] != ["complete", "interrupted", "complete"]:
        return False, 0
    t0, cut, retry = turns
    kept = cut["output_ids"]
    reuse = retry["events"][0]["data"].get("reused_tokens") if retry["events"] else None
    ok = (
        retry["prompt_ids"] == cut["prompt_ids"]
        and reuse == len(t0["prompt_ids"]) + len(t0["output_ids"])
        and retry["output_ids"][: len(kept)] == kept
    )
    return ok, len(kept)


async def _start(
    workdir: Path, opts: argparse.Namespace, engine: str, services: list[Service], store: str | None
) -> tuple[str, Service, list[Service]]:
    """The URL the clients use, the gateway to kill, and (replicated) the others: one gateway on its
    SQLite file, or ``--replicas`` gateways on the PostgreSQL `store` behind HAProxy."""
    count = 1 if store is None else opts.replicas
    names = ["crash"] if store is None else [f"replica-{chr(ord('a') + i)}" for i in range(count)]
    gws = [_gateway(workdir, n, opts.model, engine, free_port(), store=store) for n in names]
    for g in gws:
        services.append(g)
        g.start()
    for g in gws:
        await asyncio.to_thread(g.wait_ready, 120)
    if store is None:
        return base_url(gws[0]), gws[0], []
    lb = haproxy_service(workdir, [(g.name, base_url(g)) for g in gws])
    services.append(lb)
    lb.start()
    await asyncio.to_thread(lb.wait_ready, 30)
    return base_url(lb), gws[0], gws[1:]


async def _settled(http: httpx.AsyncClient, url: str, sid: str, timeout: float) -> dict[str, Any]:
    """The session's trajectory once its interrupted turn reads as such: a replica marks a dead one's
    running turns when the retry begins its turn, or at its next sweep (`gateway.turns.orphan_sweep`)."""
    deadline = time.monotonic() + timeout
    while True:
        traj: dict[str, Any] = (await http.get(f"{url}/api/sessions/{sid}/trajectory")).json()
        turns = traj["turns"]
        if len(turns) < 2 or turns[1]["status"] != "running":
            return traj
        if time.monotonic() > deadline:  # figured as not continued, and said here
            progress(f"session {sid}: its interrupted turn still reads running after {timeout:g} s")
            return traj
        await asyncio.sleep(0.1)  # polling another process's progress, with a deadline


async def _crash_run(
    workdir: Path, opts: argparse.Namespace, engine: str, services: list[Service], store: str | None = None
) -> None:
    """Kill the (first) gateway under ``--sessions`` streams: restart it on its port and store (`store`
    None), or leave it dead and let the balancer send the retries to the other replicas; the figures,
    prefixed ``replicas_`` for the latter."""
    url, victim, others = await _start(workdir, opts, engine, services, store)
    sessions = [_Session() for _ in range(opts.sessions)]
    killed = asyncio.Event()
    limits = httpx.Limits(max_connections=opts.sessions * 2, max_keepalive_connections=opts.sessions * 2)
    async with httpx.AsyncClient(limits=limits, timeout=120.0, trust_env=False) as http:
        tasks = [
            asyncio.create_task(_session(http, url, s, killed, opts), name=f"session {i}")
            for i, s in enumerate(sessions)
        ]
        await until(lambda: all(s.received >= opts.kill_after for s in sessions),
                    f"every stream's first {opts.kill_after} tokens", 300, hopeless=lambda: failure(tasks))  # fmt: skip
        assert victim.proc is not None
        proc = victim.proc
        killed.set()
        t_kill = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # the gateway process itself, by its PID
        await asyncio.to_thread(proc.wait)
        streamed = sum(s.received for s in sessions)
        if store is None:
            progress(f"gateway killed with {streamed} tokens streamed; restarting it")
            again = _gateway(
                workdir, "crash", opts.model, engine, int(url.rsplit(":", 1)[1])
            )  # same port, store
            services.append(again)
            again.start()
            await asyncio.to_thread(again.wait_ready, 120)
        else:
            progress(f"{victim.name} killed with {streamed} tokens streamed; retries go to the others")
        await asyncio.gather(*tasks)
        trajs = [await _settled(http, url, s.sid, opts.settle_deadline) for s in sessions]
        for g in others:
            if g.proc is None or g.proc.poll() is not None:
                raise BenchError(f"{g.name} died during the run:\n{g.tail()}")
    results = [_continued(t) for t in trajs]
    lost = sum(
        2 - sum(t["status"] in ("complete", "interrupted") for t in traj["turns"][:2]) for traj in trajs
    )
    received = sum(s.received for s in sessions)
    kept = sum(min(k, s.received) for (_, k), s in zip(results, sessions, strict=True))
    firsts = [s.first_after_crash - t_kill for s in sessions if s.first_after_crash is not None]
    pre = "" if store is None else "replicas_"
    if store is not None:
        emit("replicas", 1 + len(others))
    emit(f"{pre}sessions", len(sessions))
    emit(f"{pre}sessions_continued_pct", 100.0 * sum(ok for ok, _ in results) / len(sessions))
    emit(f"{pre}turns_lost", lost)
    emit(f"{pre}tokens_kept_pct", 100.0 * kept / received if received else 0.0)
    emit(f"{pre}first_token_after_crash_s", statistics.median(firsts))
    emit(f"{pre}first_token_after_crash_max_s", max(firsts))
    emit(f"{pre}retries_per_session", statistics.mean(s.retries for s in sessions))


def crash(workdir: Path, opts: argparse.Namespace) -> None:
    services: list[Service] = []
    with running(services):
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "engine_pool.fake",
            "--port",
            str(port),
            "--token-delay",
            str(opts.token_delay),
        ]
        engine = Service("engine", argv, f"http://127.0.0.1:{port}/health", workdir / "engine.log")
        start(services, engine, timeout=60)
        asyncio.run(_crash_run(workdir, opts, base_url(engine), services))
        if opts.replicas > 1:
            from belayer.testing.postgres_local import database_url

            with database_url(opts.store) as store:
                asyncio.run(_crash_run(workdir, opts, base_url(engine), services, store))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench gateway-crash", description=__doc__)
    p.add_argument("--model", default=".cache/tiny-model")
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--kill-after", type=int, default=40, help="tokens every stream has before the kill")
    p.add_argument("--reply-tokens", type=int, default=1000, help="max_tokens of the long replies")
    p.add_argument("--token-delay", type=float, default=0.02, help="the engine's seconds between tokens")
    p.add_argument("--retry-deadline", type=float, default=120.0)
    p.add_argument("--concurrency", type=int, default=32, help="streams in the overhead measurement")
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds per gateway")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="2 or more: also kill the first of this many replicas on PostgreSQL behind HAProxy, not restarted",
    )
    p.add_argument("--store", metavar="URL", help="the replicas' PostgreSQL (postgresql://...)")
    p.add_argument("--postgres", metavar="URL", help="as --store; auto: a throwaway local server")
    p.add_argument(
        "--settle-deadline",
        type=float,
        default=30.0,
        help="seconds to wait for a dead replica's turns to read interrupted (its sweep)",
    )
    opts = p.parse_args(argv[1:] if argv[:1] == ["gateway-crash"] else argv)
    opts.store = opts.store or opts.postgres
    if opts.replicas > 1 and not opts.store:
        p.error("--replicas needs --store postgresql://... or --postgres auto")
    if opts.replicas < 1:
        p.error("--replicas must be at least 1")
    interrupt_on_sigterm()
    ensure_model(opts.model)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="belayer-bench-gateway-crash-") as tmp:
        if not opts.skip_overhead:
            overhead(Path(tmp), opts)
        crash(Path(tmp), opts)
    emit("bench_wall_s", time.monotonic() - t0)
    return 0
