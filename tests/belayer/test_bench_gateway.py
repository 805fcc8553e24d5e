"""``belayer bench gateway``: the figures issue 15 asks for, measured in one (short) run over real
processes (a fake engine, gateways), and the CPU-time reading they come from."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from belayer.bench.proc_tree import tree_cpu_s

SHORT = ["--no-litellm", "--requests", "20", "--warmup", "3", "--concurrency", "4"]
SHORT += ["--stream-tokens", "32", "--stream-ramp", "0.2", "--stream-seconds", "0.5", "--stream-rounds", "1"]


def _figures(tiny_model_dir: Path, *extra: str) -> dict[str, str]:
    argv = [
        sys.executable,
        "-m",
        "belayer.cli",
        "bench",
        "gateway",
        "--model",
        str(tiny_model_dir),
        *SHORT,
        *extra,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines())


def test_tree_cpu_counts_a_process_and_its_children() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    before, t0 = tree_cpu_s(os.getpid()), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", spin + "\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        while tree_cpu_s(os.getpid()) - before - (time.process_time() - t0) < 0.25:  # the child's share
            assert time.monotonic() < deadline, "the child's CPU time never showed"
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()


def test_bench_gateway_reports_cpu_latency_and_throughput_in_one_run(tiny_model_dir: Path) -> None:
    figures = _figures(tiny_model_dir)
    for name in (
        "gateway_added_latency_p50_ms",
        "gateway_added_latency_p99_ms",
        "stream_tokens_per_s_direct",
        "stream_tokens_per_s_gateway",
        "stream_gateway_vs_direct_ratio",
        "gateway_cpu_us_per_token",
        "gateway_cpu_us_per_streamed_token",
        "gateway_cpu_us_per_request",
        "gateway_cpu_ms_per_request",
    ):
        assert float(figures[name]) == float(figures[name]), name  # a number, not nan
    assert float(figures["gateway_cpu_us_per_request"]) > 0
    assert float(figures["gateway_cpu_us_per_token"]) > 0
    assert "direct_cpu_us_per_request" not in figures  # the engine's CPU is not the gateway's
    assert figures["target_gateway_cpu_le_40us_per_token"] in ("pass", "fail")


@pytest.mark.postgres
def test_bench_gateway_compares_one_and_two_processes_on_postgres(tiny_model_dir: Path) -> None:
    figures = _figures(tiny_model_dir, "--processes-compare")
    assert float(figures["stream_tokens_per_s_gateway_pg_1proc"]) > 0
    assert float(figures["stream_tokens_per_s_gateway_pg_2proc"]) > 0
    assert float(figures["stream_2proc_vs_1proc_ratio"]) > 0
    assert float(figures["gateway_pg_2proc_cpu_us_per_token"]) > 0  # both processes' CPU, from /proc
