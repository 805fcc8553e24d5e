"""``belayer bench fork``, scaled down (fork at turn 3 into 2 siblings, short LLM calls and tool calls): it
completes and prints each of its figures, on the in-memory sandboxes and (marker ``docker``) on Docker
containers checkpointed with CRIU. The bench drives a gateway in its own process through ASGI: it must
use a Host the gateway answers (it used ``gw``, which the default allowed hosts refuse with a 400, and
crashed on the session's missing id). No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

FIGURES = ["backend", "at_turn", "siblings", "fork_replayed_tool_calls", "fork_ready_s", "rerun_ready_s",
           "fork_speedup", "fork_store_bytes", "rerun_store_bytes", "fork_store_bytes_ratio",
           "target_fork_speedup", "target_fork_store_bytes_ratio"]  # fmt: skip


def _run(tiny_model_dir: Path, backend: str) -> dict[str, str]:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "fork", "--model", str(tiny_model_dir),
            "--backend", backend, "--at-turn", "3", "--siblings", "2", "--llm-latency", "0.05", "--tool-s", "0.05"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    assert (figures["backend"], figures["at_turn"], figures["siblings"]) == (backend, "3", "2")
    # the checkpoint follows turn 0's tool call: the fork replays the journaled turns 1 and 2
    assert figures["fork_replayed_tool_calls"] == "2"
    for name in ("fork_ready_s", "rerun_ready_s", "fork_speedup", "fork_store_bytes_ratio"):
        assert not math.isnan(float(figures[name])), name
    assert int(figures["rerun_store_bytes"]) > 0
    assert {figures["target_fork_speedup"], figures["target_fork_store_bytes_ratio"]} <= {"pass", "fail"}
    return figures


def test_bench_fork_on_in_memory_sandboxes(tiny_model_dir: Path) -> None:
    _run(tiny_model_dir, "fake")


@pytest.mark.docker
def test_bench_fork_on_docker_containers(tiny_model_dir: Path, python_image: str) -> None:
    _run(tiny_model_dir, "docker")
