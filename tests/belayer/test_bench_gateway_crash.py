"""``belayer bench gateway-crash``, scaled down (two sessions, short replies, one overhead round): it
completes and prints each of its figures; the sessions it kills the gateway under continue and lose no
turn. With ``--replicas 2`` (marker ``postgres``), the replicas' figures too. No timing is asserted: the
figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

CRASH = ["sessions", "sessions_continued_pct", "turns_lost", "tokens_kept_pct", "first_token_after_crash_s",
         "first_token_after_crash_max_s", "retries_per_session"]  # fmt: skip
OVERHEAD = [
    "stream_tokens_per_s_inflight_on",
    "stream_tokens_per_s_inflight_off",
    "inflight_flush_overhead_ratio",
]


def _run(tiny_model_dir: Path, *extra: str) -> dict[str, str]:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "gateway-crash", "--model", str(tiny_model_dir)]
    argv += ["--sessions", "2", "--kill-after", "5", "--reply-tokens", "200", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split(": ", 1) for line in done.stdout.splitlines())


def _numbers(figures: dict[str, str], names: list[str]) -> None:
    for name in names:
        assert not math.isnan(float(figures[name])), name


def test_bench_gateway_crash_continues_every_session_after_the_restart(tiny_model_dir: Path) -> None:
    figures = _run(tiny_model_dir, "--rounds", "1", "--concurrency", "4", "--stream-tokens", "16")
    assert sorted(figures) == sorted([*OVERHEAD, *CRASH, "bench_wall_s"]), figures
    _numbers(figures, [*OVERHEAD, *CRASH, "bench_wall_s"])
    assert (figures["sessions"], figures["turns_lost"]) == ("2", "0"), figures
    assert float(figures["sessions_continued_pct"]) == 100.0, figures
    assert float(figures["retries_per_session"]) >= 1


@pytest.mark.postgres
def test_bench_gateway_crash_behind_a_balancer_continues_on_the_other_replica(tiny_model_dir: Path) -> None:
    figures = _run(tiny_model_dir, "--skip-overhead", "--replicas", "2", "--postgres", "auto")
    replicas = [f"replicas_{name}" for name in CRASH]
    assert sorted(figures) == sorted([*CRASH, "replicas", *replicas, "bench_wall_s"]), figures
    _numbers(figures, [*CRASH, *replicas, "bench_wall_s"])
    assert (figures["replicas"], figures["replicas_sessions"], figures["replicas_turns_lost"]) == (
        "2",
        "2",
        "0",
    )
    assert float(figures["replicas_sessions_continued_pct"]) == 100.0, figures
