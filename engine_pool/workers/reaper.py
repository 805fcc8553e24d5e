"""``python -m engine_pool.workers.reaper CMD...``: what the pool launches a worker through, so that a gateway
that dies (even by SIGKILL) leaves none of the worker's processes behind.

A vLLM server starts helper processes of its own (the engine core, a resource tracker). The kernel's
parent-death signal reaches only a direct child, so with the server as the gateway's child its helpers
outlived a killed gateway. The reaper leads the worker's process group (the pool starts it in a new
session) and runs the command in that group: when the gateway dies, the reaper gets SIGTERM (its
parent-death signal) and kills the whole group. When the gateway stops the worker itself, it signals the
whole group; the reaper then only waits for the command and exits with its code. The command gets
SIGKILL if the reaper dies, so a ``kill -9`` of the worker's pid (the reaper's) still ends the server at
once, and the pool fences the rest of the group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import FrameType

PR_SET_PDEATHSIG = 1
NICE_ENV = "BELAYER_REAPER_NICE"
"""The nice value the reaper runs the command at (``VllmWorker.start_nice`` below the gateway's); not
passed on to it."""


def parent_death_signal(sig: int) -> None:
    """Ask the kernel for `sig` when this process's parent dies (Linux; elsewhere nothing)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def _kill_group() -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(os.getpgrp(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m engine_pool.workers.reaper CMD [ARGS...]\n")
        return 2
    parent = os.getppid()
    parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # the gateway died before the signal was asked for
        _kill_group()

    def on_term(signum: int, frame: FrameType | None) -> None:
        if os.getppid() != parent:  # the gateway is gone: nobody else will clean up the group
            _kill_group()
        # else the gateway is stopping the worker: it signalled the whole group itself

    signal.signal(signal.SIGTERM, on_term)
    if niced := os.environ.pop(NICE_ENV, ""):  # before the command: it, and all it starts, inherit it
        os.setpriority(os.PRIO_PROCESS, 0, int(niced))
    child = subprocess.Popen(argv, preexec_fn=lambda: parent_death_signal(signal.SIGKILL))
    return child.wait()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
