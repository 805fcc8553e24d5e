"""A gateway killed with SIGKILL leaves none of its workers' processes behind, grandchildren included
(a vLLM server's engine core and resource tracker used to outlive it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# A stand-in gateway: launches one worker through the pool's own launcher, whose command leaves a
# grandchild (as vLLM's server does), prints the worker's process group, and waits to be killed.
GATEWAY = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from engine_pool.workers.worker import VllmWorker, WorkerSpec

    class Spec(WorkerSpec):
        def argv(self):
            return ["/bin/sh", "-c", "sleep 600 & sleep 600"]

    worker = VllmWorker(Spec(model="m", port=1), Path(sys.argv[1]), "w")
    worker.launch()
    print(worker.pid, flush=True)
    time.sleep(600)
    """
)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def group_members(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,pgid="], capture_output=True, text=True, check=True)
    return [int(p) for p, g in (line.split() for line in out.stdout.splitlines()) if int(g) == pgid]


def test_a_killed_gateway_takes_its_workers_process_groups_with_it(tmp_path: Path) -> None:
    gateway = subprocess.Popen(
        [sys.executable, "-c", GATEWAY, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert gateway.stdout is not None
        pgid = int(gateway.stdout.readline())
        deadline = time.monotonic() + 30
        while len(group_members(pgid)) < 4:  # reaper, sh, two sleeps
            assert time.monotonic() < deadline, group_members(pgid)
            time.sleep(0.05)  # processes starting in another process: poll
        gateway.kill()
        gateway.wait()
        deadline = time.monotonic() + 30
        while group_alive(pgid):
            assert time.monotonic() < deadline, f"left behind: {group_members(pgid)}"
            time.sleep(0.05)  # the group dies asynchronously (a signal chain): poll, bounded
    finally:
        gateway.kill()
        if "pgid" in locals() and group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)


def test_a_kill_of_the_workers_pid_ends_its_server_at_once() -> None:
    """The pool's pid for a worker is the reaper's: a kill -9 of it must still end the server (the
    stream breaks and fails over at once); the pool fences what is left of the group."""
    reaper = subprocess.Popen(
        [sys.executable, "-m", "engine_pool.workers.reaper", "sleep", "600"], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 30
        while len(group_members(reaper.pid)) < 2:  # the reaper and its server
            assert time.monotonic() < deadline, group_members(reaper.pid)
            time.sleep(0.05)  # a process starting in another process: poll
        [server] = [p for p in group_members(reaper.pid) if p != reaper.pid]
        reaper.kill()
        reaper.wait()
        deadline = time.monotonic() + 10
        while group_alive(reaper.pid):
            assert time.monotonic() < deadline, f"the server outlived its reaper: {group_members(reaper.pid)}"
            time.sleep(0.05)  # the kernel delivers the parent-death signal: poll, bounded
        assert server not in group_members(reaper.pid)
    finally:
        if group_alive(reaper.pid):
            os.killpg(reaper.pid, signal.SIGKILL)
