"""``belayer bench env-recovery``, scaled down (20 tool calls, short LLM calls, a small build and 1 MiB of
data) on a real Docker engine with CRIU (marker ``docker``): it completes and prints each of its
figures, the standby recovery's among them. The bench drives a gateway in its own process through ASGI: it must use a Host the gateway
answers (it used ``gw``, which the default allowed hosts refuse with a 400, and crashed with a KeyError on
the session's missing id). No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from belayer.bench.env_recovery import PHASES, STANDBY_PHASES

pytestmark = pytest.mark.docker

FIGURES = ["tool_calls", "failure_after_tool_call", "restored_checkpoint_turn", "replay_recovery_s",
           "checkpoint_recovery_s", "env_recovery_speedup", "stale_checkpoint_turn",
           "stale_checkpoint_replayed_calls", "stale_checkpoint_recovery_s", "stale_env_recovery_speedup",
           "episode_no_ckpt_s", "episode_adaptive_s", "failure_free_overhead_pct", "checkpoints_taken",
           "checkpoints_deferred", "checkpoint_mean_s", "checkpoints_in_bubbles_pct",
           "target_env_recovery_speedup", "target_failure_free_overhead", "target_checkpoints_in_bubbles",
           *(f"checkpoint_recovery_{phase}_s" for phase in PHASES), "standby_make_s", "standby_recovery_s",
           *(f"standby_recovery_{phase}_s" for phase in STANDBY_PHASES), "standby_env_recovery_speedup",
           "standbys_made", "target_standby_env_recovery_speedup"]  # fmt: skip
TARGETS = {"target_env_recovery_speedup", "target_failure_free_overhead", "target_checkpoints_in_bubbles",
           "target_standby_env_recovery_speedup"}  # fmt: skip


def test_bench_env_recovery_restores_a_checkpoint_and_replays(
    tiny_model_dir: Path, python_image: str
) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "env-recovery", "--model", str(tiny_model_dir),
            "--tool-calls", "20", "--llm-latency", "0.1", "--work", "1000", "--data-mib", "1",
            "--stale-lag", "2"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    for name in set(FIGURES) - TARGETS:
        assert not math.isnan(float(figures[name])), name
    # checkpoint_recovery_s is the sum of its phases (each printed to the millisecond)
    phases = sum(float(figures[f"checkpoint_recovery_{phase}_s"]) for phase in PHASES)
    assert math.isclose(phases, float(figures["checkpoint_recovery_s"]), abs_tol=0.01), figures
    standby = sum(float(figures[f"standby_recovery_{phase}_s"]) for phase in STANDBY_PHASES)
    assert math.isclose(standby, float(figures["standby_recovery_s"]), abs_tol=0.01), figures
    assert (figures["tool_calls"], figures["failure_after_tool_call"]) == ("20", "16")
    # the failure comes after tool call 16: a checkpoint of the first k <= 17 calls, then 17 - k replayed
    assert int(figures["checkpoints_taken"]) >= 1
    assert 0 <= int(figures["stale_checkpoint_turn"]) <= int(figures["restored_checkpoint_turn"]) <= 17
    assert int(figures["stale_checkpoint_replayed_calls"]) == 17 - int(figures["stale_checkpoint_turn"]) >= 2
    assert {figures[name] for name in TARGETS} <= {"pass", "fail"}
