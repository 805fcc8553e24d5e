"""``belayer bench task-start``, scaled down (each mode once, on ``tasks/fix-greet``) on a real Docker
engine (marker ``docker``): it completes and prints each of its figures. No timing is asserted: the
figures are the bench's."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

TASK = Path(__file__).resolve().parents[2] / "tasks" / "fix-greet"


def test_bench_task_start_times_a_cold_a_cached_and_an_uploaded_start(python_image: str) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "task-start", "--task", str(TASK), "--repeat", "1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    timed = ["task_start_s_cold", "task_start_s_cached", "task_start_s_upload", "cold_over_cached"]
    assert sorted(figures) == sorted(["task", *timed]), figures
    assert figures["task"].startswith("fix-greet (")
    for name in timed:
        assert not math.isnan(float(figures[name])), name
