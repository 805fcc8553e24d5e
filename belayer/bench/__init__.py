"""Benchmarks run from the command line (``belayer bench gateway``). Each prints its figures on stdout
as ``name: value`` lines (`emit`) and its progress on stderr (`belayer.testing.services.progress`).

Run through ``belayer bench``, a bench's stdout holds its figures only: `keep_stdout_for_figures` sends
everything else written there (a library's warning, a child process's output) to stderr."""

import os
import sys
from typing import TextIO

_figures: TextIO | None = None
"""Where `emit` writes once `keep_stdout_for_figures` ran; else ``sys.stdout``."""


def keep_stdout_for_figures() -> None:
    """Give stdout to `emit` alone: the process's file descriptor 1 (which libraries and child processes
    write to) and ``sys.stdout`` both go to stderr from now on; figures go to the original stdout."""
    global _figures
    sys.stdout.flush()
    _figures = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(name: str, value: float | int | str, digits: int = 3) -> None:
    """One figure, as ``name: value`` (a float with `digits` decimals).

    >>> emit("fork_speedup", 9.31549), emit("siblings", 4)
    fork_speedup: 9.315
    siblings: 4
    (None, None)
    """
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    print(f"{name}: {text}", file=_figures or sys.stdout, flush=True)
