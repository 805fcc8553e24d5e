"""The blocking sandbox backend behind the manager's own bounded thread pools.

An exec holds a thread for as long as its command runs (up to an hour), so execs get a pool of their
own (`SandboxConfig.exec_threads`), and everything short (create, destroy, status, files, checkpoint,
restore, checkpoint deletion) another (`SandboxConfig.op_threads`). Long tool calls in many
sessions then never hold up another session's checkpoint or status poll, and asyncio's default pool
stays free for the rest of the gateway.

An exec's deadline counts from when its thread starts, not from when it was queued: a call that
waits for a free thread has not hung its sandbox.

It also carries the disk limits (`SandboxConfig.max_workspace_bytes`, and the backend's disk quota,
enforced by the storage driver or else checked before each checkpoint), and says at start-up, in one
log line, which of them hold.

Example::

    io = SandboxIO(backend, settings)
    box = await io.op(backend.create, spec)
    result = await io.call(lambda b: backend.exec(b, "make"), box.id, long=True, deadline=75.0)
    io.close()
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from core.errors import SandboxError, SandboxNotFound
from sandbox.backend import SandboxBackend, SandboxStatus
from sandbox.config import SandboxConfig
from sandbox.network import SandboxNetwork

log = logging.getLogger("belayer.sandbox")
P = ParamSpec("P")
T = TypeVar("T")


class SandboxIO:
    """Runs `backend` calls in the manager's two pools (see the module docstring)."""

    def __init__(self, backend: SandboxBackend, settings: SandboxConfig) -> None:
        self.backend = backend
        self.network: SandboxNetwork | None = backend.network
        self.max_workspace_bytes = settings.max_workspace_bytes
        """The verify stage copies at most this much of a working directory (`sandbox.sessions.verify`)."""
        enforced, why = backend.disk_quota()
        self.check_disk_quota = backend.disk_quota_bytes is not None and not enforced
        """The storage driver does not hold sandboxes to their quota: checkpoints check it themselves."""
        log_disk_limits(backend.disk_quota_bytes, enforced, why, self.max_workspace_bytes)
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


def log_disk_limits(quota: int | None, enforced: bool, why: str, max_workspace_bytes: int) -> None:
    """One line: what holds a sandbox's disk use (and with it the gateway's, at verify and checkpoint)."""
    if quota is None:
        held = "no disk quota (sandbox.disk_quota_bytes unset)"
    elif enforced:
        held = f"disk quota {quota} bytes per sandbox, enforced ({why})"
    else:
        held = (
            f"disk quota {quota} bytes per sandbox NOT enforced ({why}): writes are not stopped, but a "
            "checkpoint of a larger writable layer is refused (sandbox_checkpoint_refused)"
        )
    fields = {
        "disk_quota_bytes": quota,
        "disk_quota_enforced": enforced,
        "max_workspace_bytes": max_workspace_bytes,
    }
    log.info(
        "sandbox disk limits: %s; the verify stage copies at most %d bytes of a working directory",
        held, max_workspace_bytes, extra=fields,
    )  # fmt: skip


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
