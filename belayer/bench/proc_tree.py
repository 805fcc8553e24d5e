"""A process and its live descendants, from ``/proc``: their pids (`tree_pids`), CPU time (`tree_cpu_s`),
resident memory and open descriptors (`rss_and_fds`), sampled in a thread for their peak (`watch`). A
gateway's children (``--processes``) run in sessions of their own, so the tree goes by parent pid, not by
process group."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _stats() -> dict[int, tuple[int, int]]:
    """Every process's parent pid and CPU ticks (user + system), from its ``/proc/PID/stat``."""
    out: dict[int, tuple[int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            # the fields after the command (which may hold spaces): state ppid ... utime (11) stime (12)
            out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _tree(root: int, stats: dict[int, tuple[int, int]]) -> set[int]:
    seen, frontier = {root}, {root}
    while frontier:
        frontier = {p for p, (pp, _) in stats.items() if pp in frontier} - seen
        seen |= frontier
    return seen


def tree_pids(root: int) -> set[int]:
    """`root` and its live descendants."""
    return _tree(root, _stats())


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) used so far by process `root` and its live descendants (one that died
    and was restarted loses its share)."""
    stats = _stats()
    return sum(stats[p][1] for p in _tree(root, stats) if p in stats) * _TICK_S


def rss_and_fds(root: int) -> tuple[float, int]:
    """Resident memory (MB) and open descriptors of process `root` and its descendants."""
    rss_kb, fds = 0, 0
    for pid in tree_pids(root):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss_kb += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
    return rss_kb / 1024, fds


@dataclass(slots=True)
class Peak:
    """The highest resident memory and descriptor count seen by `watch`."""

    rss_mb: float = 0.0
    fds: int = 0


@contextlib.contextmanager
def watch(root: int, interval_s: float = 0.5) -> Iterator[Peak]:
    """Sample `root`'s process tree in a thread while the block runs."""
    peak, stop = Peak(), threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            rss, fds = rss_and_fds(root)
            peak.rss_mb, peak.fds = max(peak.rss_mb, rss), max(peak.fds, fds)

    thread = threading.Thread(target=sample, name="scale-watch", daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()
