"""How a bench waits for a condition (a busy worker, a running stream, a pool back at strength): with a
deadline, and, when it gives up, a `BenchError` that names what it waited for (and why it stopped early,
when the condition can no longer come: the stream ended, a task failed). Never an endless poll, a bare
``TimeoutError``, or a ``StopIteration`` raised inside a coroutine by a ``next()`` that found nothing.

Example::

    await until(lambda: len(arrivals) >= 20, "the stream's first 20 tokens", 300)
    victim = await found(lambda: busy_worker(http, url), "a worker serving the stream", 60,
                         hopeless=lambda: ended(stream, arrivals))
    await within(manager.idle(), "the checkpoints in the background", 600)

>>> asyncio.run(until(lambda: False, "a miracle", 0.05))
Traceback (most recent call last):
...
core.errors.BenchError: gave up waiting for a miracle after 0.05 s
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from core.errors import BenchError

T = TypeVar("T")


async def found(
    probe: Callable[[], Awaitable[T | None]],
    what: str,
    timeout: float,
    *,
    interval: float = 0.02,
    hopeless: Callable[[], str | None] = lambda: None,
) -> T:
    """The first result of `probe` (awaited every `interval` seconds) that is not None. Raises `BenchError`
    naming `what` when `timeout` seconds pass first, or as soon as `hopeless` gives a reason (the thing
    can no longer come)."""
    deadline = time.monotonic() + timeout
    while True:
        if (result := await probe()) is not None:
            return result
        if reason := hopeless():
            raise BenchError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() >= deadline:
            raise BenchError(f"gave up waiting for {what} after {timeout:g} s")
        await asyncio.sleep(interval)  # polling another process (or task), with a deadline


async def until(
    condition: Callable[[], bool],
    what: str,
    timeout: float,
    *,
    interval: float = 0.02,
    hopeless: Callable[[], str | None] = lambda: None,
) -> None:
    """Until `condition()` holds (checked every `interval` seconds); as `found` when it does not in time."""

    async def holds() -> bool | None:
        return True if condition() else None

    await found(holds, what, timeout, interval=interval, hopeless=hopeless)


async def within(awaitable: Awaitable[T], what: str, timeout: float) -> T:
    """`awaitable`'s result, or a `BenchError` naming `what` when it takes over `timeout` seconds."""
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except TimeoutError:
        raise BenchError(f"gave up waiting for {what} after {timeout:g} s") from None


def failure(tasks: Iterable[asyncio.Task[Any]]) -> str | None:
    """The first of `tasks` that ended with an exception, as ``name: error`` (None: none has): for
    ``hopeless`` (`found`, `until`) while those tasks bring the condition about."""
    for task in tasks:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            return f"{task.get_name()} failed: {type(error).__name__}: {error}"
    return None
