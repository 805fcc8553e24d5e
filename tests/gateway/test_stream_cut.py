"""A stream cut because its worker's process exited (`stall_guarded`'s cut, ``gateway.turns.guard``):
the cut's error is raised after the chunks that arrived before it, whatever the engine sends after, and
however the pump and the turn are ordered (the turn once took the pump's early end for the stream's)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import pytest

from core.errors import WorkerExited
from engine_pool.engine.client import TokenChunk
from gateway.turns.guard import stall_guarded


async def never_stalls() -> bool:
    raise AssertionError("no stall may be waited out: the cut comes first")


class Engine:
    """Chunks 1 and 2, each once released; then the stream ends."""

    def __init__(self) -> None:
        self.release = [asyncio.Event(), asyncio.Event()]

    async def chunks(self) -> AsyncGenerator[TokenChunk, None]:
        for i, release in enumerate(self.release):
            await release.wait()
            yield TokenChunk([i + 1], [-0.5])


def guarded(engine: Engine) -> tuple[AsyncGenerator[TokenChunk, None], set[Callable[[Exception], None]]]:
    streams: set[Callable[[Exception], None]] = set()
    return stall_guarded(engine.chunks(), "w0", 600.0, never_stalls, None, streams), streams


@pytest.mark.parametrize("pump_first", [True, False], ids=["pump-ends-first", "turn-wakes-first"])
async def test_a_cut_raises_its_error_after_the_chunks_before_it(pump_first: bool) -> None:
    engine = Engine()
    stream, streams = guarded(engine)
    first = asyncio.create_task(anext(stream))
    engine.release[0].set()
    assert (await first).token_ids == [1]
    waiting = asyncio.create_task(anext(stream))  # the turn waits for the next chunk
    await asyncio.sleep(0)
    [cut] = streams
    error = WorkerExited("worker w0: the reaper (pid 1) exited", at=1.0)
    if pump_first:  # chunk 2 reaches the pump, which drops it and ends, before the turn wakes
        engine.release[1].set()
        cut(error)
    else:
        cut(error)
        engine.release[1].set()
    with pytest.raises(WorkerExited) as raised:
        await waiting
    assert raised.value is error
    await stream.aclose()
    assert streams == set()  # the stream's cut is no longer the worker's


async def test_an_uncut_stream_reads_to_its_end_and_leaves_the_workers_streams() -> None:
    engine = Engine()
    stream, streams = guarded(engine)
    for release in engine.release:
        release.set()
    got = [t async for c in stream for t in c.token_ids]
    assert got == [1, 2] and streams == set()
