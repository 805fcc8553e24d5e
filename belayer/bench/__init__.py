"""Benchmarks run from the command line (``belayer bench gateway``). Each prints its figures on stdout
as ``name: value`` lines (`emit`) and its progress on stderr (`belayer.testing.services.progress`).

Run through ``belayer bench``, a bench's stdout holds its figures only: `stdout_for_figures` sends
everything else written there (a library's warning, a child process's output) to stderr while it runs."""

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

_figures: TextIO | None = None
"""Where `emit` writes inside `stdout_for_figures`; else ``sys.stdout``."""


@contextlib.contextmanager
def stdout_for_figures() -> Iterator[None]:
    """Give stdout to `emit` alone while the block runs: the process's file descriptor 1 (which libraries
    and child processes write to) and ``sys.stdout`` both go to stderr, figures to the original stdout.
    Both are put back afterwards (``belayer bench`` run in-process by a test leaves its stdout as it was)."""
    global _figures
    sys.stdout.flush()
    saved_fd, saved_stdout = os.dup(1), sys.stdout
    _figures = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stderr.flush()
        _figures.close()
        _figures = None
        os.dup2(saved_fd, 1)
        os.close(saved_fd)
        sys.stdout = saved_stdout


def emit(name: str, value: float | int | str, digits: int = 3) -> None:
    """One figure, as ``name: value`` (a float with `digits` decimals).

    >>> emit("fork_speedup", 9.31549), emit("siblings", 4)
    fork_speedup: 9.315
    siblings: 4
    (None, None)
    """
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    print(f"{name}: {text}", file=_figures or sys.stdout, flush=True)
