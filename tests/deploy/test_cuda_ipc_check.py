"""deploy/gpu/cuda_ipc_check.py without a GPU: its --help, the clear skip (or exit 3 with --require-gpu)
when no CUDA device is visible, and its whole owner/consumer/kill/remap protocol in shared memory
(``--device cpu``), which is what the GPU run does with CUDA IPC handles."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from tests.support import REPO

SCRIPT = REPO / "deploy" / "gpu" / "cuda_ipc_check.py"
NO_GPU_ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no device visible, even on a GPU machine


def check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    # The timeout only turns a hang into a failure: the protocol run starts several processes that each
    # import torch, which took over 120 s on a loaded 2-core machine. It runs in a session of its own, and
    # a hang kills the whole group: a consumer orphaned by a hung run spun on a core for an hour after it.
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=NO_GPU_ENV, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what the script left behind, if anything
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_help() -> None:
    done = check("--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "--require-gpu" in text and "--device {cuda,cpu}" in text and "--mib" in text
    assert "skipped: no CUDA device" in text


def test_without_a_cuda_device_it_says_so() -> None:
    done = check()
    assert (done.returncode, done.stdout) == (0, "skipped: no CUDA device\n"), done.stderr
    done = check("--require-gpu")
    assert done.returncode == 3
    assert done.stdout.startswith("error: no CUDA device"), done.stdout
    assert check("--mib", "0").returncode == 2


@pytest.mark.serial  # its owner and consumers each import torch: beside 3 test processes, one run hung
@pytest.mark.slow  # and on a loaded machine it hung past its 600 s once more (cause unknown): make test-all
def test_the_protocol_in_shared_memory() -> None:
    done = check("--device", "cpu", "--mib", "4", "--dim", "128")
    assert done.returncode == 0, done.stdout + done.stderr
    facts = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert facts["tensors"] == "64" and float(facts["weights_mib"]) == 4.0
    for name in ("map_s", "compute_s", "kill_to_exit_s", "remap_s", "recompute_s", "remap_ready_s"):
        assert float(facts[name]) >= 0, name
    assert facts["consumer_result_matches_owner"] == "True"
    assert facts["owner_tensors_intact_after_kill"] == "True"
    assert facts["remapped_result_matches_owner"] == "True"
    assert facts["consumer_survives_owner_kill"] == "True"  # shared memory outlives its owner
    assert facts["result"] == "passed"
