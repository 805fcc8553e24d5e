"""One owner for background work: every task has a name, a failure is logged, and close() cancels and
joins what is left. The pool, the sandbox manager and the turn runner each hold one. Periodic work (a
health probe, a sweep, a sampler) is `TaskOwner.every`: one loop that sleeps, runs a step, and outlives
a step that fails.

Example::

    owner = TaskOwner("engine-pool")
    owner.spawn(warm_up(), "warm-up")
    owner.every(5.0, probe, "probe")   # await probe() every 5 s until close
    await owner.join()         # wait for what is running (tests, a drain)
    await owner.close()        # cancel what is left and wait for it

>>> import asyncio
>>> async def demo() -> list[str]:
...     owner = TaskOwner("demo")
...     done: list[str] = []
...     async def work() -> None:
...         done.append("ran")
...     owner.spawn(work(), "work")
...     await owner.join()
...     await owner.close()
...     return done
>>> asyncio.run(demo())
['ran']
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

log = logging.getLogger("belayer.tasks")

Step = Callable[[], Awaitable[object]]
"""One round of periodic work (`TaskOwner.every`)."""


class TaskOwner:
    """Spawns named tasks, logs the ones that fail, and cancels and joins them on `close`."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.failures = 0
        """Tasks that ended with an exception, and steps of periodic work that raised (each one is logged)."""

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `work` as a task named ``<owner>/<name>``. After `close`, the coroutine is closed unrun."""
        if self._closed:
            work.close()
            raise RuntimeError(f"{self.owner} is closed; no new background work")
        task = asyncio.get_running_loop().create_task(work, name=f"{self.owner}/{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def every(self, interval_s: float | Callable[[], float], step: Step, name: str) -> asyncio.Task[None]:
        """Await `step()` every `interval_s` seconds (the first time one interval from now) until `close`,
        in a task named ``<owner>/<name>``; a callable `interval_s` is read before each sleep (a setting
        that may change). A step that raises is logged and counted in `failures`, and the next one runs
        on time: one bad round does not end periodic work."""
        interval = interval_s if callable(interval_s) else lambda: interval_s
        return self.spawn(self._repeat(interval, step, name), name)

    async def _repeat(self, interval: Callable[[], float], step: Step, name: str) -> None:
        while True:
            await asyncio.sleep(interval())
            try:
                await step()
            except Exception as exc:  # cancellation (close) is not an Exception: it ends the loop
                self.failures += 1
                log.error("periodic task %s/%s failed: %s", self.owner, name, exc, exc_info=exc)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self.failures += 1
            log.error("background task %s failed: %s", task.get_name(), exc, exc_info=exc)

    @property
    def running(self) -> int:
        return len(self._tasks)

    async def join(self) -> None:
        """Wait until no task is running (tasks spawned meanwhile are waited for too)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Cancel every task and wait for all of them; no new task can be spawned afterwards."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def started_threads(workers: int | None = None) -> concurrent.futures.ThreadPoolExecutor:
    """A thread pool for ``asyncio.to_thread`` (the loop's default executor) whose `workers` threads
    (by default as many as asyncio's own: the CPUs + 4, at most 32) are all running before it is
    used. A ``ThreadPoolExecutor`` starts a thread when a task finds none idle, and ``Thread.start``
    waits until the new thread runs: on a busy host the event loop waited for that, 80-100 ms, once right
    after a worker's death, when the CPUs are scarcest and a stream is resuming.

    >>> pool = started_threads(3)
    >>> len(pool._threads), pool.submit(sum, [1, 2]).result(), len(pool._threads)
    (3, 3, 3)
    >>> pool.shutdown()
    """
    workers = workers or min(32, (os.cpu_count() or 1) + 4)
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="belayer-thread")
    gate = threading.Barrier(workers + 1)
    for _ in range(workers):  # each finds no idle thread (the ones before wait at the gate): one more
        pool.submit(gate.wait)
    gate.wait()
    return pool
