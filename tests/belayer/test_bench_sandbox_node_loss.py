"""``belayer bench sandbox-node-loss``, scaled down (two short episodes of two tool calls) on a Ray cluster
and two Docker engines of its own (markers ``sandbox_cluster``, ``docker``, ``ray``): it completes and
prints each of its figures. Its Ray nodes take the three loopback addresses after the test session's
shared cluster (`tests/conftest.py`'s ``ray_cluster``, which may be up). No timing is asserted: the
figures are the bench's."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.sandbox_cluster,
    pytest.mark.docker,
    pytest.mark.ray,
    pytest.mark.slow,
]  # minutes: make test-all

FIRST_IP = int(os.environ.get("BELAYER_TEST_RAY_FIRST_IP", "2")) + 3
"""The bench's nodes: after the shared cluster's three (read before the autouse fixture drops BELAYER_*)."""
FIGURES = ["lost_sandboxes", "node_loss_restored_s_p50", "node_loss_restored_s_max", "restored_pct", "rerun_s",
           "node_loss_speedup", "node_losses", "leaked_containers"]  # fmt: skip


def test_bench_sandbox_node_loss_restores_the_lost_sandboxes_elsewhere() -> None:
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must run the sandbox_cluster tests: run deploy/host/setup_sandbox_host.sh install first"
            )
        pytest.skip(
            "the bench starts a Docker engine per node: needs root and dockerd (setup_sandbox_host.sh)"
        )
    argv = [sys.executable, "-m", "belayer.cli", "bench", "sandbox-node-loss", "--sandboxes", "2", "--steps", "2",
            "--step-s", "0.1", "--first-ip", str(FIRST_IP)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    for name in FIGURES:
        assert not math.isnan(float(figures[name])), name
    assert int(figures["lost_sandboxes"]) >= 1 and int(figures["node_losses"]) >= 1
