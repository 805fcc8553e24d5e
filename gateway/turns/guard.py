"""A worker's stream, guarded: read by a pump task while the turn waits with a deadline, so that a stall,
a worker's exit and a weight update's cut each end it at once (``gateway.turns.failover`` decides what
follows).

A worker that stops sending tokens (hung, not dead) is noticed after ``stall_timeout`` seconds, once a
health probe confirms it (`EngineTimeout`). A launched worker whose process exited has its streams cut by
the pool (``engine_pool.workers.exits``: `PoolMember.streams`), and a weight update cuts the streams still running
when its drain time is over (`Preempted`, from the pool's `Preemption`); what arrived before a cut is
the turn's, what comes after it is dropped.

Example::

    async for chunk in stall_guarded(client.generate(prompt, params, stream=True), "worker-0", 30.0,
                                     confirm, pool.preemption, member.streams):
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field

from core.errors import BelayerError, EngineTimeout
from engine_pool.engine.client import TokenChunk, merge_chunks
from engine_pool.pool import Preemption


class Preempted(BelayerError):
    """A weight update cut this stream (its drain time was over); the turn resumes after it."""


@dataclass(slots=True)
class _Pipe:
    """Chunks handed from the task that reads the engine to the turn that consumes them."""

    items: list[TokenChunk] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    error: Exception | None = None
    lost: Exception | None = None
    """Set by `cut`: the worker is gone; what arrives after it is not read."""

    async def fill(self, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        try:
            async for chunk in chunks:
                if self.lost is not None:
                    break
                self.items.append(chunk)
                self.wake.set()
        except Exception as e:
            self.error = e
        finally:
            self.done = True
            self.wake.set()
            await chunks.aclose()

    def cut(self, error: Exception) -> None:
        """The worker's process exited (``engine_pool.workers.exits``): the stream fails now, after the chunks
        that already arrived, whatever its socket still holds or is still sent. A stream read to its
        end is left to end."""
        if not (self.done and self.error is None):
            self.lost = self.lost or error
            self.wake.set()


async def stall_guarded(
    chunks: AsyncGenerator[TokenChunk, None],
    worker: str,
    stall_timeout: float,
    confirm_failure: Callable[[], Awaitable[bool]],
    preemption: Preemption | None = None,
    streams: set[Callable[[Exception], None]] | None = None,
) -> AsyncGenerator[TokenChunk, None]:
    """The engine's chunks, read by a pump task while this side waits with a deadline: no token within
    `stall_timeout` and a failed health probe (`confirm_failure`) raise ``EngineTimeout``. Chunks that
    piled up while the client was being served are merged, so the hand-off costs one wake-up per
    batch, not per token. A triggered `preemption` raises `Preempted` (the chunks read are kept). While
    it runs, its cut is in `streams` (the worker's, `PoolMember.streams`): a cut raises its error at
    once, after the chunks that arrived before it."""
    pipe = _Pipe()
    pump = asyncio.create_task(pipe.fill(chunks), name=f"engine-pump/{worker}")
    if preemption is not None:
        preemption.watch(pipe.wake)
    if streams is not None:
        streams.add(pipe.cut)
    try:
        while True:
            cut = pipe.lost or (
                Preempted(f"a weight update cut the stream from {worker}")
                if preemption is not None and preemption.triggered and not pipe.done
                else None
            )
            if cut is not None:
                if pipe.items:  # what arrived before the cut is the turn's; what comes after is dropped
                    batch, pipe.items = pipe.items, []
                    yield merge_chunks(batch) or batch[0]
                raise cut
            if not pipe.items and not pipe.done:
                pipe.wake.clear()
                try:
                    async with asyncio.timeout(stall_timeout):
                        await pipe.wake.wait()
                except TimeoutError:
                    if await confirm_failure():
                        raise EngineTimeout(
                            f"{worker} sent no token for {stall_timeout}s and failed its health probe"
                        ) from None
                continue  # look again from the top: a cut (whose pump ends the stream early) first
            if pipe.items:
                batch, pipe.items = pipe.items, []
                merged = merge_chunks(batch)
                assert merged is not None
                yield merged
            elif pipe.error is not None:
                raise pipe.error
            elif pipe.done:
                return
    finally:
        if preemption is not None:
            preemption.unwatch(pipe.wake)
        if streams is not None:
            streams.discard(pipe.cut)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
