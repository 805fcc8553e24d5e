"""Benchmarks run from the command line (``belayer bench gateway``). Each prints its figures on stdout
as ``name: value`` lines (`emit`) and its progress on stderr (`belayer.testing.services.progress`)."""


def emit(name: str, value: float | int | str, digits: int = 3) -> None:
    """One figure, as ``name: value`` (a float with `digits` decimals).

    >>> emit("fork_speedup", 9.31549), emit("siblings", 4)
    fork_speedup: 9.315
    siblings: 4
    (None, None)
    """
    text = f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    print(f"{name}: {text}", flush=True)
