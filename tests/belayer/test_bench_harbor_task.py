"""``belayer bench harbor-task``, scaled down (one round; the bench's own task with 1 MiB of data in its
working directory) on a real Docker engine (marker ``docker``): a real gateway with sandboxes, the oracle
solving the task cold, warm clean and warm shared (reward 1.0 each), every figure printed, and the
image it built for its run removed at the end. No timing is asserted: the figures are the bench's."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.docker_backend import DockerSandboxBackend

pytestmark = pytest.mark.docker

TIMED = ["harbor_task_start_s_cold", "harbor_task_start_s_warm", "harbor_start_cold_over_warm",
         "harbor_verify_s_clean", "harbor_verify_s_shared", "harbor_verify_clean_over_shared",
         "harbor_verify_reported_s_clean", "harbor_verify_reported_s_shared", "harbor_episode_s_warm",
         "harbor_episode_s_warm_shared"]  # fmt: skip
REWARDS = ["harbor_reward_cold", "harbor_reward_clean", "harbor_reward_shared"]


def test_bench_harbor_task_runs_the_oracle_cold_warm_clean_and_shared(
    backend: DockerSandboxBackend, python_image: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "belayer.cli", "bench", "harbor-task", "--repeat", "1", "--workspace-mib", "1",
            "--model", str(tiny_model_dir), "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert sorted(figures) == sorted(["task", "workspace_mib", *TIMED, *REWARDS]), figures
    assert (figures["task"], figures["workspace_mib"]) == ("harbor-bench (1 rounds)", "1")
    assert [figures[name] for name in REWARDS] == ["1.000"] * 3
    for name in TIMED:
        assert float(figures[name]) > 0 and not math.isnan(float(figures[name])), name
    assert re.findall(r"round 1/1 (\w+):", done.stderr) == ["cold", "clean", "shared"]
    dockerfile = (tmp_path / "harbor-bench" / "environment" / "Dockerfile").read_text()
    assert dockerfile.startswith(f"FROM {python_image}\n")
    run_label = re.search(r"^LABEL (belayer\.bench\.run=\w+)$", dockerfile, re.MULTILINE)
    assert run_label is not None, dockerfile
    assert backend.images(run_label.group(1)) == []  # the run's image, built for it, is gone
