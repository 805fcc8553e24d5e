"""``belayer bench sandbox-restart``, scaled down (one sandbox) on a real Docker engine with CRIU (marker
``docker``): it completes (its own checks hold: the counter lived through the adoption, and the restore
brought back the checkpoint's count and the journaled file) and prints each of its figures. No timing is
asserted: the figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.docker

FIGURES = ["sandboxes", "adopt_per_sandbox_s", "adopt_startup_s", "restore_per_sandbox_s", "restore_startup_s",
           "adopt_speedup"]  # fmt: skip


def test_bench_sandbox_restart_adopts_then_restores(python_image: str) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "sandbox-restart", "--sandboxes", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    assert figures["sandboxes"] == "1"
    for name in FIGURES:
        assert not math.isnan(float(figures[name])), name
