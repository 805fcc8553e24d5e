"""``belayer bench scale``: thousands of concurrent multi-turn sessions through one gateway process, and
through ``--processes 2`` on PostgreSQL, on fake engines with realistic timing.

For each size N (``--sizes``, default 1,000, 2,000 and 4,000) a fresh gateway starts in front of one
fake engine that streams each reply at its own rate (``--token-rate``: 20 to 50 tokens per second per
stream, the first token after one token's delay). N sessions start over ``--ramp-s`` seconds; each
creates its session (``POST /api/sessions``), then runs ``--turns`` streamed chat turns at its session
base URL, each turn's messages extending the previous turn's (prefix reuse), with a tool pause of
``--pause`` seconds (uniform) between turns, then closes the session. Each session is one client with one
keep-alive connection, as a harness is. The figures, per size N:

* ``errors_N``: sessions through the gateway that failed (an HTTP error, a connection refused or reset,
  a stream cut off); ``direct_errors_N``: the baseline's, apart;
* ``added_latency_p99_ms_N``: the p99 of the time to first token through the gateway, minus the p99 of
  the fake engine's own, measured in the same run by direct sessions (``--direct`` or a tenth of N,
  whichever is more, in addition to the N) that stream from the engine with the same pattern;
* ``event_loop_lag_p99_ms_N``: the gateway's event-loop lag (``belayer_event_loop_lag_seconds``, a
  sampler that sleeps 0.1 s and records how late it wakes), p99 over the run (every process's);
* ``store_write_lag_p99_ms_N``: a turn's store write from its request to its commit
  (``belayer_store_write_seconds``, begin and finish), p99 over the run;
* ``gateway_rss_mb_N``, ``gateway_fds_N``: the gateway's peak resident memory (all its processes) and
  open descriptors; ``gateway_cpu_cores_N``: its CPU time over the run per second (1.0: one core busy);
  ``machine_loadavg_1m_N``: the machine's load at the end (another job on a shared machine shows there);
  then ``rss_mb_per_1000_sessions``: the growth of resident memory from the idle gateway (warmed up by
  16 sessions first, so that its one-time costs are not counted per session) to its peak, per 1,000
  sessions, at the largest size.

Every process raises its soft open-file limit as far as it needs (one descriptor per session, and the
gateway's own `gateway.serve.server.connection_budget`), and the bench fails with what to do when the
hard limit is too low.

Then the same with 2 processes (suffix ``_2proc``; ``--processes 1,2``, needs PostgreSQL's binaries,
`belayer.testing.postgres_local`). One process runs on its default store (SQLite).

**Keeping the load generator honest.** The gateway, the fake engine and the generator share the machine
(two cores here), so the generator must be cheap and must say when it was the bottleneck: it runs in
``--clients`` processes of its own (so that no one event loop carries every session's chunks), each on
``engine_pool.engine.http11``'s transport (``httptools``' C parser, the gateway's own engine leg) with
``orjson``; sessions spend most of their time in tool pauses (sleeping), and each client process samples
its own event-loop lag as the gateway does: ``generator_loop_lag_p99_ms_N`` is printed beside the
gateway's, so a time to first token inflated by the generator shows there. The direct baseline runs in
the same client processes, so their lag inflates both sides alike. The generator is
`belayer.bench.scale_clients`; the gateway's memory and CPU come from `belayer.bench.proc_tree`, its
histograms' quantiles from `belayer.bench.stats`.

Figures go to stdout as ``name: value`` lines (with ``target_*: pass|fail``), progress to stderr.

Example::

    belayer bench scale                                  # 1,000, 2,000, 4,000; 1 and 2 processes
    belayer bench scale --sizes 200 --processes 1 --pause 0.2,0.5 --turns 2
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from belayer.bench import emit
from belayer.bench.proc_tree import rss_and_fds, tree_cpu_s, watch
from belayer.bench.scale_clients import FD_MARGIN, Plan, Tally, client_process, raise_fd_limit, run_clients
from belayer.bench.stand_up import ensure_model, interrupt_on_sigterm, optional_postgres
from belayer.bench.stats import Histograms, histogram_quantile, merge, parse_histograms, percentile, subtract
from belayer.testing.services import (
    FAKE_MODEL,
    Service,
    base_url,
    gateway_service,
    progress,
    running,
)
from core.errors import BenchError
from core.net import free_port

if TYPE_CHECKING:
    from belayer.testing.postgres_local import PostgresServer

DEFAULT_MODEL_DIR = ".cache/tiny-model"
ERRORS_AT = 4000
"""``errors_4000`` must be 0 (on this 2-core machine)."""
ADDED_LATENCY_AT, ADDED_LATENCY_P99_MS = 2000, 50.0
RSS_MB_PER_1000 = 50.0


# --- the gateway's side ------------------------------------------------------------------------------


FAMILIES = ("belayer_event_loop_lag_seconds", "belayer_store_write_seconds")


def scrape(url: str, processes: int, attempts: int = 50) -> Histograms:
    """The gateway's histograms, summed over its `processes` (each connection's ``/health`` names the
    process that accepted it, and its ``/metrics`` on the same connection is that process's)."""
    seen: dict[int, Histograms] = {}
    for _ in range(attempts):
        with httpx.Client(timeout=30.0, trust_env=False) as http:
            pid = int(http.get(f"{url}/health").json().get("pid", 0))
            if pid not in seen:
                seen[pid] = parse_histograms(http.get(f"{url}/metrics").text, FAMILIES)
        if len(seen) >= processes:
            return merge(list(seen.values()))
    raise BenchError(f"/metrics reached {len(seen)} of {processes} gateway processes")


def warm_up(gateway: str, engine: str, opts: argparse.Namespace, sessions: int = 16) -> None:
    """A few sessions before measuring: the gateway's one-time costs (its first templating, its worker
    threads, caches) are not counted per session."""
    plan = Plan(
        gateway=gateway, engine=engine, sessions=sessions, direct=0, turns=2, tokens=opts.tokens,
        pause=(0.05, 0.1), ramp_s=0.5, start_at=0.0, seed=-1, timeout_s=opts.request_timeout_s,
    )  # fmt: skip
    tally = Tally()
    asyncio.run(run_clients(plan, tally))
    if tally.errors:
        raise BenchError(f"the warm-up failed: {tally.first_errors}")


# --- one size ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class SizeResult:
    size: int
    errors: int
    direct_errors: int
    first_errors: list[str]
    turns: int
    added_p99_ms: float
    gateway_ttft_p99_ms: float
    direct_ttft_p99_ms: float
    loop_lag_p99_ms: float
    store_write_p99_ms: float
    generator_lag_p99_ms: float
    rss_idle_mb: float
    rss_peak_mb: float
    fds_peak: int
    seconds: float
    cpu_cores: float
    """The gateway's CPU time (all its processes) over the run, per second: 1.0 is one core busy."""
    loadavg: float
    """The machine's 1-minute load average at the end (another job on the machine shows here)."""


def run_size(
    opts: argparse.Namespace, gateway: Service, engine_url: str, size: int, processes: int
) -> SizeResult:
    """N sessions through `gateway` (started, idle), measured (module docstring)."""
    assert gateway.proc is not None
    url = base_url(gateway)
    clients = max(1, opts.clients)
    direct = max(opts.direct, size // 10)
    warm_up(url, engine_url, opts)
    start_at = time.time() + 2.0 + 0.2 * clients  # every client process started and waiting
    plans = [
        Plan(
            gateway=url,
            engine=engine_url,
            sessions=size // clients + (i < size % clients),
            direct=direct // clients + (i < direct % clients),
            turns=opts.turns,
            tokens=opts.tokens,
            pause=opts.pause,
            ramp_s=opts.ramp_s,
            start_at=start_at,
            seed=opts.seed * 1000 + i,
            timeout_s=opts.request_timeout_s,
        )
        for i in range(clients)
    ]
    before = scrape(url, processes)
    rss_idle, _ = rss_and_fds(gateway.proc.pid)
    progress(f"{size} sessions (+{direct} direct) over {clients} client processes, ramp {opts.ramp_s} s")
    t0, cpu0 = time.monotonic(), tree_cpu_s(gateway.proc.pid)
    ctx = multiprocessing.get_context("spawn")
    with watch(gateway.proc.pid) as peak, ctx.Pool(clients) as pool:  # its exit terminates the clients
        results = pool.map(client_process, plans, chunksize=1)
    seconds = time.monotonic() - t0
    cpu_cores = (tree_cpu_s(gateway.proc.pid) - cpu0) / seconds
    hist = subtract(scrape(url, processes), before)
    ttft_gw = [x for r in results for x in r["ttft_gateway"]]
    ttft_direct = [x for r in results for x in r["ttft_direct"]]
    lag = [x for r in results for x in r["loop_lag"]]

    def p99_ms(xs: list[float]) -> float:
        return percentile(xs, 99) * 1000 if xs else float("nan")

    def hist_p99_ms(name: str) -> float:
        return histogram_quantile(hist.get(name, {}), 0.99) * 1000

    return SizeResult(
        size=size, errors=sum(r["errors"] for r in results),
        direct_errors=sum(r["direct_errors"] for r in results),
        first_errors=[e for r in results for e in r["first_errors"]][:5],
        turns=sum(r["turns"] for r in results),
        added_p99_ms=p99_ms(ttft_gw) - p99_ms(ttft_direct),
        gateway_ttft_p99_ms=p99_ms(ttft_gw), direct_ttft_p99_ms=p99_ms(ttft_direct),
        loop_lag_p99_ms=hist_p99_ms(FAMILIES[0]), store_write_p99_ms=hist_p99_ms(FAMILIES[1]),
        generator_lag_p99_ms=p99_ms(lag), rss_idle_mb=rss_idle, rss_peak_mb=peak.rss_mb,
        fds_peak=peak.fds, seconds=seconds, cpu_cores=cpu_cores, loadavg=os.getloadavg()[0],
    )  # fmt: skip


def report(r: SizeResult, suffix: str) -> None:
    n = f"{r.size}{suffix}"
    emit(f"errors_{n}", r.errors)
    emit(f"direct_errors_{n}", r.direct_errors)
    emit(f"added_latency_p99_ms_{n}", r.added_p99_ms)
    emit(f"event_loop_lag_p99_ms_{n}", r.loop_lag_p99_ms)
    emit(f"store_write_lag_p99_ms_{n}", r.store_write_p99_ms)
    emit(f"ttft_p99_ms_gateway_{n}", r.gateway_ttft_p99_ms)
    emit(f"ttft_p99_ms_direct_{n}", r.direct_ttft_p99_ms)
    emit(f"generator_loop_lag_p99_ms_{n}", r.generator_lag_p99_ms)
    emit(f"turns_{n}", r.turns)
    emit(f"gateway_rss_mb_{n}", r.rss_peak_mb, 1)
    emit(f"gateway_fds_{n}", r.fds_peak)
    emit(f"run_s_{n}", r.seconds, 1)
    emit(f"gateway_cpu_cores_{n}", r.cpu_cores, 2)
    emit(f"machine_loadavg_1m_{n}", r.loadavg, 2)
    for e in r.first_errors:
        progress(f"  error ({n}): {e}")


# --- the servers -------------------------------------------------------------------------------------


def engine_service(workdir: Path, opts: argparse.Namespace) -> Service:
    """The fake engine: ``--tokens`` per reply, each stream at its own rate within ``--token-rate``."""
    port = free_port()
    slow, fast = opts.token_rate
    argv = [sys.executable, "-m", "belayer.cli", "fake-engine", "--port", str(port), "--model", FAKE_MODEL]
    argv += ["--tokens", str(opts.tokens), "--token-delay", str(1 / fast), "--token-delay-max", str(1 / slow)]
    return Service("fake-engine", argv, f"http://127.0.0.1:{port}/health", workdir / "fake-engine.log")


def run_processes(
    opts: argparse.Namespace, workdir: Path, engine: Service, processes: int, postgres: PostgresServer | None
) -> list[SizeResult]:
    """Every size through a fresh gateway of `processes` processes (on PostgreSQL when more than one)."""
    results = []
    for size in opts.sizes:
        name = f"gateway-{processes}p-{size}"
        store = postgres.new_database() if postgres is not None else None
        gw = gateway_service(
            workdir, opts.model, base_url(engine), opts.gateway_log_level, name=name, store=store,
            processes=processes,
        )  # fmt: skip
        services = [gw]
        with running(services):
            gw.start()
            gw.wait_ready(opts.startup_timeout)
            result = run_size(opts, gw, base_url(engine), size, processes)
            results.append(result)
            report(result, "" if processes == 1 else f"_{processes}proc")
    return results


def run(opts: argparse.Namespace, workdir: Path) -> None:
    services: list[Service] = []
    with optional_postgres(any(p > 1 for p in opts.processes)) as postgres, running(services):
        engine = engine_service(workdir, opts)
        services.append(engine)
        engine.start()
        engine.wait_ready(opts.startup_timeout)
        for processes in opts.processes:
            progress(f"--- {processes} gateway process(es) ---")
            results = run_processes(opts, workdir, engine, processes, postgres if processes > 1 else None)
            suffix = "" if processes == 1 else f"_{processes}proc"
            emit(f"rss_mb_per_1000_sessions{suffix}", rss_per_1000(results), 1)
            report_targets(results, suffix)


def rss_per_1000(results: list[SizeResult]) -> float:
    """The resident memory a gateway grew by from idle to its peak, per 1,000 sessions, at the largest size."""
    largest = max(results, key=lambda r: r.size)
    return (largest.rss_peak_mb - largest.rss_idle_mb) / largest.size * 1000


def report_targets(results: list[SizeResult], suffix: str) -> None:
    by_size = {r.size: r for r in results}
    if ERRORS_AT in by_size:
        emit(f"target_errors_{ERRORS_AT}_zero{suffix}", "pass" if by_size[ERRORS_AT].errors == 0 else "fail")
    if ADDED_LATENCY_AT in by_size:
        ok = by_size[ADDED_LATENCY_AT].added_p99_ms < ADDED_LATENCY_P99_MS
        emit(f"target_added_latency_p99_{ADDED_LATENCY_AT}_under_50ms{suffix}", "pass" if ok else "fail")
    ok = rss_per_1000(results) < RSS_MB_PER_1000
    emit(f"target_rss_per_1000_sessions_under_50mb{suffix}", "pass" if ok else "fail")


# --- the command -------------------------------------------------------------------------------------


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    pair = (float(lo), float(hi or lo))
    if pair[0] <= 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"want LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return pair


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["scale"]:
        argv = argv[1:]
    p = argparse.ArgumentParser(
        prog="belayer bench scale", description="thousands of concurrent multi-turn sessions per gateway"
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL_DIR, help="the gateway's model directory (built if missing)"
    )
    p.add_argument(
        "--sizes", type=_ints, default=[1000, 2000, 4000], help="concurrent sessions, e.g. 1000,2000"
    )
    p.add_argument(
        "--processes", type=_ints, default=[1, 2],
        help="gateway processes, e.g. 1,2 (more than 1: on a throwaway PostgreSQL)",
    )  # fmt: skip
    p.add_argument("--turns", type=int, default=3, help="streamed turns per session")
    p.add_argument("--tokens", type=int, default=32, help="tokens per reply")
    p.add_argument("--token-rate", type=_pair, default=(20.0, 50.0), help="tokens/s per stream: LOW,HIGH")
    p.add_argument("--pause", type=_pair, default=(2.0, 8.0), help="tool pause between turns (s): LOW,HIGH")
    p.add_argument("--ramp-s", type=float, default=10.0, help="seconds over which the sessions start")
    p.add_argument(
        "--direct", type=int, default=64,
        help="sessions straight to the engine (the baseline): this many, or a tenth of N if more",
    )  # fmt: skip
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="a request's timeout (per read)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gateway-log-level", default="WARNING", help="the gateway's --log-level")
    p.add_argument("--startup-timeout", type=float, default=120.0, help="seconds a server may take to start")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs (the folder is printed)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    opts = parse_args(argv)
    previous = interrupt_on_sigterm()
    try:
        raise_fd_limit(FD_MARGIN * 4)
        ensure_model(opts.model)
        workdir = Path(tempfile.mkdtemp(prefix="belayer-scale-"))
        ok = False
        t0 = time.monotonic()
        try:
            run(opts, workdir)
            ok = True
        finally:
            if opts.keep_logs or not ok:
                progress(f"server logs kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        emit("bench_wall_s", time.monotonic() - t0, 1)
        emit("machine_cpus", os.cpu_count() or 0)
        emit("machine_memory_gib", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
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
