"""``belayer bench verify-copy``, scaled down (a 4 MiB workspace) on a real Docker engine (marker
``docker``): it completes (the verifier saw the whole workspace) and prints each of its figures. No
timing or memory bound is asserted: the figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.docker

FIGURES = ["workspace_mib", "verify_copy_peak_traced_mib", "verify_copy_peak_per_workspace",
           "verify_copy_rss_growth_mib", "verify_copy_s"]  # fmt: skip


def test_bench_verify_copy_verifies_a_small_workspace(busybox_image: str) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "verify-copy", "--mib", "4"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(FIGURES), figures
    assert figures["workspace_mib"] == "4"
    for name in FIGURES:
        assert not math.isnan(float(figures[name])), name
