"""A launched worker's death, noticed at once (`ExitWatch`): a pidfd per vital process, read by the event loop.

A worker the pool launched is a process group on this host (``engine_pool.workers.worker``): the reaper (the
pool's own child, whose pid the pool shows), the server it runs, and the processes that server starts. When
a vital one of them exits, the worker is lost, and waiting to be told costs time:

- a server killed with its group closes its sockets only once the kernel has torn down its memory (tens
  of milliseconds for a vLLM server), while the reaper, small, is gone at once;
- vLLM 0.32 runs its engine core (and, with tensor parallelism, its model workers) in processes of their
  own (``VLLM_ENABLE_V1_MULTIPROCESSING``, the ``gpu`` profile). When the engine core dies, the API
  server lingers: it ends the streams with an error event, answers ``/health`` with 503, and exits only
  when its watchdog looks, up to 5 s later.

So the watch opens a pidfd (``os.pidfd_open``, Linux 5.3+) for each vital process and hands it to the
event loop (``loop.add_reader``): a pidfd turns readable when its process exits, so the pool hears of the
exit in the loop iteration it happens in, with no polling, probe or timeout. It fires once, with the time
it noticed (``time.monotonic()``: ``CLOCK_MONOTONIC``, which every process of the host shares), then
closes. Whoever stops the worker on purpose (a removal, a fence, the pool's stop) closes the watch first,
so a planned stop is never taken for a death.

The vital processes (`vital`): the reaper, its child (the server), and every process of the group whose
title is one of vLLM's own (``VLLM::EngineCore``, ``VLLM::Worker_TP0``...: vLLM titles the processes it
starts as ``$VLLM_PROCESS_NAME_PREFIX::NAME``). The group's other processes (multiprocessing's resource
tracker, compile workers) may come and go, and are not watched. The group is read once the worker is
ready, when vLLM has started its engine core. Workers given by URL and workers on Ray nodes have no
process here: probes and broken connections notice their loss, as before.

Example::

    watch = ExitWatch(lambda why, at: print(why, at))
    for pid, what in vital(worker_pgid, "VLLM"):
        watch.add(pid, what)
    ...
    watch.close()  # a planned stop: nothing fires
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path

OnExit = Callable[[str, float], None]
"""Called once, with why (which process exited) and when it was noticed (``time.monotonic()``)."""

PROC = Path("/proc")


class ExitWatch:
    """pidfds of one worker's vital processes on the running loop; `on_exit` once, at the first exit."""

    def __init__(self, on_exit: OnExit) -> None:
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._fds: dict[int, str] = {}
        self._closed = False
        self.fired: str | None = None
        """Why it fired (None: it has not)."""

    @property
    def watching(self) -> int:
        """How many processes it watches (0 once it fired or was closed)."""
        return len(self._fds)

    def add(self, pid: int, what: str) -> bool:
        """Watch `pid` (named `what` in the reason given); False where pidfds are not supported. A
        process already gone fires the watch in the loop's next iteration."""
        if self._closed:
            return True
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.gone(f"{what} (pid {pid}) exited")
            return True
        except (AttributeError, OSError):  # no pidfd_open (not Linux, or a kernel before 5.3)
            return False
        self._fds[fd] = f"{what} (pid {pid}) exited"
        self._loop.add_reader(fd, self._readable, fd)
        return True

    def gone(self, why: str) -> None:
        """A vital process that is gone already: the watch fires in the loop's next iteration."""
        self._loop.call_soon(self._fire, why, time.monotonic())

    def _readable(self, fd: int) -> None:
        self._fire(self._fds.get(fd, "a watched process exited"), time.monotonic())

    def _fire(self, why: str, at: float) -> None:
        if self._closed:
            return
        self.fired = why
        self.close()
        self._on_exit(why, at)

    def close(self) -> None:
        """Stop watching (a planned stop): nothing fires afterwards."""
        self._closed = True
        for fd in self._fds:
            self._loop.remove_reader(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def vital(pgid: int, prefix: str = "VLLM") -> list[tuple[int, str]]:
    """The vital processes of the process group `pgid` (module docstring), each with what it is: the
    leader (the reaper), its children (the server), and those titled ``PREFIX::NAME`` (vLLM's own)."""
    found = []
    for pid, ppid, argv in group(pgid):
        if pid == pgid:
            found.append((pid, "the reaper"))
        elif ppid == pgid:
            found.append((pid, "the server"))
        elif argv and argv[0].startswith(f"{prefix}::"):
            found.append((pid, argv[0].strip()))
    return found


def group(pgid: int) -> list[tuple[int, int, list[str]]]:
    """(pid, parent pid, command line) of every process in the group `pgid`."""
    out = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command name, which may hold spaces
        ppid, group = int(fields[1]), int(fields[2])
        if group == pgid:
            out.append((int(entry.name), ppid, argv))
    return out
