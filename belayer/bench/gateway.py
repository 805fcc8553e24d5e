"""``belayer bench gateway``: what the gateway adds over calling the engine, next to a LiteLLM proxy.

Four servers run in their own processes (each its own process group, stopped at the end even on error
or Ctrl-C): a fast fake engine, the gateway in front of it (twice: metrics on and off), and a LiteLLM
proxy in front of the same engine. The load generator runs here (asyncio + httpx) and measures, in one run:

* latency: short non-streamed chat requests, sent one at a time over one persistent client, alternating
  between the paths (in a rotating order) so that machine noise hits them alike; the added
  latency of a path is its p50 (p99) minus the direct p50 (p99);
* the cost of Prometheus metrics: a second gateway with metrics off (``BELAYER_METRICS=false``) is a
  path of its own, so ``added_p50_ms_metrics_on``/``_off`` come from the same alternating run, and
  ``metrics_overhead_ratio`` is how much longer a request's p50 through the gateway is with them (at
  most 3%);
* streamed throughput: generated tokens per second at a fixed concurrency, in alternating rounds;
* the gateway's CPU: its own CPU time (``/proc``: user + system, with every process of
  ``--processes``) over the latency phase, per request (``gateway_cpu_us_per_request``), and over the
  throughput windows, per streamed token (``gateway_cpu_us_per_token``);
* with ``--baseline-src DIR`` (a source tree of another commit, e.g. ``git archive HEAD | tar -x -C DIR``),
  a gateway run from it is one more path (``gateway_before``): before and after a change, in one run;
* with ``--processes-compare`` (needs PostgreSQL's binaries, `belayer.testing.postgres_local`), streamed
  throughput through one and two gateway processes (``--processes 2``) on one PostgreSQL store.

The paths and the load are `belayer.bench.load`'s; this module starts the servers, runs the load and
reports. Figures go to stdout as ``name: value`` lines (with ``target_*: pass|fail``), progress to stderr.
LiteLLM is installed on first use into its own virtual environment (``--litellm-venv``), so that it
cannot disturb this environment's pinned dependencies; the install is timed apart from the run.

Example::

    belayer bench gateway                     # all three paths
    belayer bench gateway --no-litellm        # direct and gateway only
    belayer bench gateway --no-litellm --baseline-src /tmp/head --processes-compare
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from belayer.bench import emit
from belayer.bench.load import StreamTally, Target, check_reply, latencies, throughput
from belayer.bench.stand_up import ensure_model, interrupt_on_sigterm, optional_postgres, start
from belayer.bench.stats import percentile
from belayer.testing.services import (
    DEFAULT_LITELLM_SPEC,
    DEFAULT_LITELLM_VENV,
    FAKE_MODEL,
    SERVED_MODEL,
    Service,
    base_url,
    ensure_litellm,
    fake_engine_service,
    gateway_service,
    litellm_service,
    progress,
    running,
)
from core.errors import BenchError

if TYPE_CHECKING:
    from belayer.testing.postgres_local import PostgresServer

DEFAULT_MODEL_DIR = ".cache/tiny-model"
RUN_BUDGET_S = 60.0
METRICS_OFF = "gateway_metrics_off"
"""The same gateway with its Prometheus metrics off: what metrics cost is the difference."""
METRICS_BUDGET = 0.03
"""Metrics may add at most 3% to a request's latency through the gateway."""
BEFORE = "gateway_before"
"""The gateway run from ``--baseline-src``: the same figures before a change."""
ONE_PROCESS, TWO_PROCESSES = "gateway_pg_1proc", "gateway_pg_2proc"
"""Gateways on one PostgreSQL store with one and two processes (``--processes-compare``)."""
CPU_US_PER_TOKEN_TARGET = 40.0


def streaming_rates(
    workdir: Path, opts: argparse.Namespace, gateways: Callable[[str], list[Service]]
) -> dict[str, float]:
    """Streamed tokens/s through each of the `gateways` (built for the engine's URL), in alternating
    rounds, in front of one fast fake engine (``opts``: stream_tokens, rounds, concurrency); the other
    benches' failure-free overhead figures."""
    services: list[Service] = []
    with running(services):
        engine = fake_engine_service(workdir, opts.stream_tokens)
        start(services, engine, timeout=60)
        gws = gateways(base_url(engine))
        start(services, *gws, timeout=120)
        targets = [Target(g.name, f"{base_url(g)}/v1/chat/completions", "policy") for g in gws]
        ns = argparse.Namespace(
            stream_tokens=opts.stream_tokens, stream_rounds=opts.rounds, concurrency=opts.concurrency,
            stream_ramp=0.5, stream_seconds=2.0,
        )  # fmt: skip

        async def go() -> dict[str, float]:
            conns = opts.concurrency * 2
            limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
            async with httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False) as http:
                tallies = await throughput(http, targets, ns)
            return {name: t.token_estimate / t.seconds for name, t in tallies.items()}

        return asyncio.run(go())


async def measure(targets: list[Target], extra: list[Target], opts: argparse.Namespace) -> None:
    """Latency over `targets`; throughput over them and the `extra` ones (the process comparison)."""
    conns = opts.concurrency * 2
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    async with httpx.AsyncClient(limits=limits, timeout=30.0, trust_env=False) as http:
        for t in targets:
            await check_reply(http, t, opts.latency_tokens)
        progress(f"latency: {opts.requests} sequential requests per path after {opts.warmup} warm-up")
        t0, cpu0 = time.monotonic(), {t.name: t.cpu_s() for t in targets}
        lat = await latencies(http, targets, opts.requests, opts.warmup, opts.latency_tokens)
        cpu = {t.name: t.cpu_s() - cpu0[t.name] for t in targets if t.pid is not None}
        progress(f"latency done in {time.monotonic() - t0:.1f} s")
        report_latency(lat)
        report_request_cpu(cpu, opts.requests + opts.warmup)
        rounds = f"{opts.stream_rounds} rounds of {opts.stream_seconds} s after {opts.stream_ramp} s ramp-up"
        progress(f"throughput: concurrency {opts.concurrency}, {rounds} per path")
        t0 = time.monotonic()
        tallies = await throughput(http, targets + extra, opts)
        progress(f"throughput done in {time.monotonic() - t0:.1f} s")
        report_throughput(tallies, opts.concurrency)


# --- the report --------------------------------------------------------------------------------------


def report_latency(lat: dict[str, list[float]]) -> None:
    direct = lat["direct"]
    for name, xs in lat.items():
        emit(f"{name}_latency_p50_ms", percentile(xs, 50))
        emit(f"{name}_latency_p99_ms", percentile(xs, 99))
    for name, xs in lat.items():
        if name != "direct":
            emit(f"{name}_added_latency_p50_ms", percentile(xs, 50) - percentile(direct, 50))
            emit(f"{name}_added_latency_p99_ms", percentile(xs, 99) - percentile(direct, 99))
    emit("latency_requests_per_path", len(direct))
    gw = percentile(lat["gateway"], 50) - percentile(direct, 50)
    emit("target_gateway_added_latency_p50_le_1ms", "pass" if gw <= 1.0 else "fail")
    report_metrics_cost(lat)
    if "litellm" in lat:
        ll = percentile(lat["litellm"], 50) - percentile(direct, 50)
        emit("gateway_vs_litellm_added_latency_ratio", gw / ll if ll > 0 else float("inf"))
        emit("target_gateway_added_latency_le_fifth_of_litellm", "pass" if gw <= ll / 5 else "fail")


def report_request_cpu(cpu: dict[str, float], requests: int) -> None:
    """A gateway's CPU time per short non-streamed request, over the whole latency phase."""
    for name, seconds in cpu.items():
        emit(f"{name}_cpu_us_per_request", seconds / requests * 1e6, 1)
        emit(f"{name}_cpu_ms_per_request", seconds / requests * 1e3)


def report_metrics_cost(lat: dict[str, list[float]]) -> None:
    """The gateway's added latency with metrics on and off, measured in the same alternating run."""
    direct = lat["direct"]
    for q in (50, 99):
        for suffix, name in (("on", "gateway"), ("off", METRICS_OFF)):
            emit(f"added_p{q}_ms_metrics_{suffix}", percentile(lat[name], q) - percentile(direct, q))
    # Paired: the two gateways are measured back to back in each round, so the median of the rounds'
    # differences cancels most of the machine's drift, which a difference of two p50s does not.
    paired = percentile([a - b for a, b in zip(lat["gateway"], lat[METRICS_OFF], strict=True)], 50)
    emit("metrics_added_p50_ms", paired)
    overhead = paired / percentile(lat[METRICS_OFF], 50)  # of a request's p50 latency through the gateway
    emit("metrics_overhead_ratio", overhead)
    emit("target_metrics_overhead_le_3pct", "pass" if overhead <= METRICS_BUDGET else "fail")


def report_throughput(tallies: dict[str, StreamTally], concurrency: int) -> None:
    rate = {name: t.token_estimate / t.seconds for name, t in tallies.items()}
    for name, t in tallies.items():
        emit(f"stream_tokens_per_s_{name}", rate[name])
        emit(f"stream_requests_finished_{name}", t.requests)
        if t.requests:
            emit(f"stream_chunks_per_request_{name}", t.chunks / t.requests)
    emit("stream_concurrency", concurrency)
    for name, t in tallies.items():
        if t.cpu_s and t.token_estimate:
            per_token = t.cpu_s / t.token_estimate * 1e6
            emit(f"{name}_cpu_us_per_token", per_token, 1)
            emit(f"{name}_cpu_us_per_streamed_token", per_token, 1)
            emit(f"{name}_cpu_cores_busy", t.cpu_s / t.seconds)
    per_token = tallies["gateway"].cpu_s / tallies["gateway"].token_estimate * 1e6
    emit("target_gateway_cpu_le_40us_per_token", "pass" if per_token <= CPU_US_PER_TOKEN_TARGET else "fail")
    if BEFORE in rate:
        emit("stream_gateway_vs_before_ratio", rate["gateway"] / rate[BEFORE])
    if TWO_PROCESSES in rate:
        emit("stream_2proc_vs_1proc_ratio", rate[TWO_PROCESSES] / rate[ONE_PROCESS])
    ratio = rate["gateway"] / rate["direct"]
    emit("stream_gateway_vs_direct_ratio", ratio)
    emit("stream_metrics_on_vs_off_ratio", rate["gateway"] / rate[METRICS_OFF])
    if "litellm" in rate:
        emit("stream_litellm_vs_direct_ratio", rate["litellm"] / rate["direct"])
    emit("target_stream_gateway_ge_70pct_of_direct", "pass" if ratio >= 0.7 else "fail")
    emit("target_stream_gateway_ge_80pct_of_direct", "pass" if ratio >= 0.8 else "fail")


# --- the command -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["gateway"]:  # ``belayer bench`` hands over everything after ``bench``
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="belayer bench gateway", description="gateway overhead vs direct vs LiteLLM"
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL_DIR, help="the gateway's model directory (built if missing)"
    )
    p.add_argument("--requests", type=int, default=300, help="measured sequential requests per path")
    p.add_argument("--warmup", type=int, default=30, help="warm-up requests per path")
    p.add_argument("--latency-tokens", type=int, default=8, help="tokens in a short non-streamed reply")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=128, help="tokens per streamed reply")
    p.add_argument("--stream-ramp", type=float, default=0.5, help="seconds of load before each window")
    p.add_argument("--stream-seconds", type=float, default=2.0, help="length of one throughput window")
    p.add_argument("--stream-rounds", type=int, default=2, help="throughput windows per path (alternating)")
    p.add_argument(
        "--gateway-log-level", default="INFO", help="the gateway's --log-level (its default: INFO)"
    )
    p.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM path")
    p.add_argument(
        "--baseline-src",
        type=Path,
        help="a source tree (e.g. `git archive HEAD | tar -x -C DIR`) whose gateway is one more path",
    )
    p.add_argument(
        "--processes-compare",
        action="store_true",
        help="also stream through 1 and 2 gateway processes on a throwaway PostgreSQL (needs its binaries)",
    )
    p.add_argument("--litellm-venv", default=DEFAULT_LITELLM_VENV, help="LiteLLM's own virtual environment")
    p.add_argument("--litellm-spec", default=DEFAULT_LITELLM_SPEC, help="pip requirement installed there")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="seconds a server may take to start")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (the folder is printed)")
    return p.parse_args(argv)


def _pid(service: Service) -> int:
    assert service.proc is not None
    return service.proc.pid


def start_servers(
    workdir: Path, opts: argparse.Namespace, services: list[Service], postgres: PostgresServer | None
) -> tuple[list[Target], list[Target]]:
    """Start the engine (and LiteLLM alongside), then the gateways, which probe the engine as they start;
    the latency and throughput paths, and those of the throughput comparison of processes."""
    engine = fake_engine_service(workdir, max(opts.stream_tokens, opts.latency_tokens))
    services.append(engine)
    engine.start()
    litellm, key = None, f"sk-bench-{secrets.token_hex(16)}"
    if not opts.no_litellm:
        litellm = litellm_service(workdir, Path(opts.litellm_venv), base_url(engine), key)
        services.append(litellm)
        litellm.start()
    engine.wait_ready(opts.startup_timeout)
    gateway = gateway_service(workdir, opts.model, base_url(engine), opts.gateway_log_level)
    bare = gateway_service(
        workdir, opts.model, base_url(engine), opts.gateway_log_level, name=METRICS_OFF, metrics=False
    )
    gateways = [gateway, bare]
    if opts.baseline_src is not None:
        src = opts.baseline_src.resolve()
        gateways.append(
            gateway_service(
                workdir, opts.model, base_url(engine), opts.gateway_log_level, name=BEFORE, source=src
            )
        )
    if postgres is not None:
        for name, n in ((ONE_PROCESS, 1), (TWO_PROCESSES, 2)):
            store = postgres.new_database()
            gw = gateway_service(
                workdir,
                opts.model,
                base_url(engine),
                opts.gateway_log_level,
                name=name,
                store=store,
                processes=n,
            )
            gateways.append(gw)
    services += gateways
    for gw in gateways:
        gw.start()
    for gw in gateways:
        gw.wait_ready(opts.startup_timeout)
    targets = [Target("direct", f"{base_url(engine)}/v1/chat/completions", FAKE_MODEL)]
    extra: list[Target] = []
    for gw in gateways:
        target = Target(gw.name, f"{base_url(gw)}/v1/chat/completions", SERVED_MODEL, pid=_pid(gw))
        (extra if gw.name in (ONE_PROCESS, TWO_PROCESSES) else targets).append(target)
    if litellm is not None:
        litellm.wait_ready(opts.startup_timeout)
        targets.append(Target("litellm", f"{base_url(litellm)}/v1/chat/completions", SERVED_MODEL, key))
    return targets, extra


def run(opts: argparse.Namespace, workdir: Path) -> float:
    """Start the servers, measure, stop them; the seconds it took."""
    t0 = time.monotonic()
    services: list[Service] = []
    with optional_postgres(opts.processes_compare) as postgres, running(services):
        targets, extra = start_servers(workdir, opts, services, postgres)
        emit("startup_s", time.monotonic() - t0)
        asyncio.run(measure(targets, extra, opts))
    return time.monotonic() - t0


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    previous = interrupt_on_sigterm()
    try:
        ensure_model(opts.model)
        if not opts.no_litellm:
            emit("litellm_setup_s", ensure_litellm(Path(opts.litellm_venv), opts.litellm_spec))
        workdir = Path(tempfile.mkdtemp(prefix="belayer-bench-"))
        ok = False
        try:
            wall = run(opts, workdir)
            ok = True
        finally:
            if opts.keep_logs or not ok:
                progress(f"server logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        emit("bench_wall_s", wall)
        emit("target_bench_under_60s", "pass" if wall < RUN_BUDGET_S else "fail")
        return 0
    except BenchError as e:
        progress(f"failed: {e}")
        return 1
    except (subprocess.CalledProcessError, httpx.HTTPError) as e:
        progress(f"failed: {e!r}")
        return 1
    except KeyboardInterrupt:
        progress("interrupted; servers stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
