"""The blocking sandbox backend behind the manager's own bounded thread pools.

An exec holds a thread for as long as its command runs (up to an hour), so execs get a pool of their
own (`SandboxConfig.exec_threads`), and everything short (create, destroy, status, files, checkpoint,
restore, checkpoint deletion) another (`SandboxConfig.op_threads`). Long tool calls in many
sessions then never hold up another session's checkpoint or status poll, and asyncio's default pool
stays free for the rest of the gateway.

An exec's deadline counts from when its thread starts, not from when it was queued: a call that
waits for a free thread has not hung its sandbox.

Example::

    io = SandboxIO(backend, settings)
    box = await io.op(backend.create, spec)
    result = await io.call(lambda b: backend.exec(b, "make"), box.id, long=True, deadline=75.0)
    io.close()
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from core.errors import SandboxError, SandboxNotFound
from gateway.config import SandboxConfig
from sandbox.backend import SandboxBackend, SandboxStatus
from sandbox.network import SandboxNetwork

P = ParamSpec("P")
T = TypeVar("T")


class SandboxIO:
    """Runs `backend` calls in the manager's two pools (see the module docstring)."""

    def __init__(self, backend: SandboxBackend, settings: SandboxConfig) -> None:
        self.backend = backend
        self.network: SandboxNetwork | None = backend.network
        self._execs = ThreadPoolExecutor(settings.exec_threads, thread_name_prefix="sandbox-exec")
        self._ops = ThreadPoolExecutor(settings.op_threads, thread_name_prefix="sandbox-op")

    async def op(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a short operation in the short-operation pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._ops, functools.partial(fn, *args, **kwargs))

    async def call(self, fn: Callable[[str], T], box: str, *, long: bool, deadline: float | None) -> T:
        """Run a tool call on sandbox `box` (an exec is `long`); `TimeoutError` when it ran `deadline`
        seconds unanswered."""
        pool = self._execs if long else self._ops
        loop = asyncio.get_running_loop()
        started: asyncio.Future[None] = loop.create_future()

        def work() -> T:
            loop.call_soon_threadsafe(_resolve, started)
            return fn(box)

        done = loop.run_in_executor(pool, work)
        if deadline is None:
            return await done
        try:
            first: list[asyncio.Future[Any]] = [started, done]
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            done.cancel()  # not started yet: it never will
            raise
        return await asyncio.wait_for(done, deadline)

    async def status(self, box: str) -> SandboxStatus | None:
        """The sandbox's state; a vanished container counts as stopped, an unreachable engine as unknown."""
        try:
            return await self.op(self.backend.status, box)
        except SandboxNotFound:
            return SandboxStatus(running=False, detail="the container no longer exists")
        except SandboxError:
            return None

    async def address(self, box: str) -> str | None:
        """The sandbox's address on the gateway network (None without one)."""
        if self.network is None:
            return None
        return await self.op(self.network.address, box)

    def close(self) -> None:
        """Stop both pools; queued work is cancelled, running calls end with their sandboxes."""
        for pool in (self._execs, self._ops):
            pool.shutdown(wait=False, cancel_futures=True)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
