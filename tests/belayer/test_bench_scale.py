"""``belayer bench scale``, scaled down: a few hundred concurrent multi-turn sessions (short tool pauses)
through one gateway process, with 0 errors and the gateway's event loop never stalled for long; and the
histogram arithmetic the figures come from.

The lag bound detects gross breakage only (a loop blocked for seconds): the suite shares a 2-core
machine with other work, so the bench's own targets (``added_latency_p99_ms_2000`` under 50) are not
asserted here."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from belayer.bench.stats import histogram_quantile, parse_histograms

LAG_BOUND_MS = 2000.0
"""The event loop's p99 lag may not reach 2 s: a loop that a write or a burst of streams blocks."""


def test_histogram_quantile_interpolates_within_the_bucket_like_prometheus() -> None:
    buckets = {0.01: 50.0, 0.1: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert histogram_quantile(buckets, 0.5) == 0.01
    assert math.isclose(histogram_quantile(buckets, 0.7), 0.055)
    assert math.isclose(histogram_quantile(buckets, 0.99), 0.91)
    assert math.isnan(histogram_quantile({math.inf: 0.0}, 0.99))
    assert histogram_quantile({1.0: 0.0, math.inf: 5.0}, 0.99) == 1.0  # beyond the last bound


def test_parse_histograms_sums_over_labels() -> None:
    text = "\n".join([
        'belayer_store_write_seconds_bucket{le="0.001",op="begin"} 3.0',
        'belayer_store_write_seconds_bucket{le="+Inf",op="begin"} 4.0',
        'belayer_store_write_seconds_bucket{le="0.001",op="finish"} 1.0',
        'belayer_store_write_seconds_bucket{le="+Inf",op="finish"} 2.0',
        "belayer_store_write_seconds_count 6.0",
    ])  # fmt: skip
    assert parse_histograms(text, ("belayer_store_write_seconds",)) == {
        "belayer_store_write_seconds": {0.001: 4.0, math.inf: 6.0}
    }


def test_bench_scale_runs_hundreds_of_sessions_without_errors(tiny_model_dir: Path) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "scale", "--model", str(tiny_model_dir)]
    argv += ["--sizes", "300", "--processes", "1", "--turns", "2", "--pause", "0.5,1.5", "--ramp-s", "3"]
    argv += ["--tokens", "16", "--direct", "30"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert figures["errors_300"] == "0", done.stderr[-3000:]
    assert int(figures["turns_300"]) == 2 * (300 + 30)
    lag = float(figures["event_loop_lag_p99_ms_300"])
    assert 0 <= lag < LAG_BOUND_MS, figures
    for name in ("added_latency_p99_ms_300", "store_write_lag_p99_ms_300", "rss_mb_per_1000_sessions"):
        assert not math.isnan(float(figures[name])), name
    assert int(figures["gateway_fds_300"]) > 50  # a keep-alive connection per live session, at the peak
    assert figures["target_rss_per_1000_sessions_under_50mb"] in ("pass", "fail")
