"""Running turns' generated tokens, written to the store while they stream.

A turn's output is written whole when it ends; until then it lives in the gateway's memory. So that a
crash of the gateway (``kill -9``, an OOM kill) keeps what was generated, the turn runner tells an
`InflightWriter` about each running turn and its new tokens, and one background task writes the new
tokens of every running turn in one transaction (`TrajectoryStore.append_outputs`), in a worker thread:
``flush_interval_s`` after the previous write, or as soon as one turn has ``flush_tokens`` new tokens.
At start-up the store marks the turns left running ``interrupted``, with the tokens they had.

A turn's output only grows (a failover resubmits prompt + output and appends what the next worker
generates), and its parts are written in order, one write at a time, so what is stored is always a
prefix of the final output; the final write (`TrajectoryStore.finish_turn`) ends a turn's run, and a
part that reaches the store after it is skipped there.

Example::

    writer = InflightWriter(store, InflightConfig(flush_interval_s=0.25, flush_tokens=256))
    writer.track(turn)
    turn.output_ids += ids; turn.output_logprobs += lps
    writer.progressed(turn)     # a write is due when enough tokens are new
    writer.untrack(turn)        # the turn ended (its final write is the runner's)
    await writer.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from core.errors import StoreError
from core.tasks import TaskOwner
from gateway.config import InflightConfig
from store import OutputPart, TrajectoryStore, TurnRecord

log = logging.getLogger("belayer.gateway")


class InflightWriter:
    """Writes running turns' new tokens in batches; see the module docstring."""

    def __init__(self, store: TrajectoryStore, config: InflightConfig) -> None:
        self.store = store
        self.config = config
        self._turns: dict[int, TurnRecord] = {}
        self._flushed: dict[int, int] = {}
        """Turn id -> how many of its output tokens the store holds (as far as this writer knows)."""
        self._due = asyncio.Event()
        self._active = asyncio.Event()
        """Set while a turn is tracked (the writer's timer runs only then)."""
        self._tasks = TaskOwner("inflight-writer")
        self._loop: asyncio.Task[None] | None = None
        self._closing = False
        self.writes = 0
        """Transactions written (tests, benchmarks)."""

    def track(self, turn: TurnRecord) -> None:
        """`turn` has begun (stored, running, no output yet)."""
        if not self.config.enabled or self._closing:
            return
        self._turns[turn.id] = turn
        self._active.set()
        self._flushed[turn.id] = len(turn.output_ids)
        if self._loop is None:
            self._loop = self._tasks.spawn(self._run(), "flush")

    def progressed(self, turn: TurnRecord) -> None:
        """`turn` has new tokens: a write is due now when ``flush_tokens`` of them are unwritten."""
        flushed = self._flushed.get(turn.id)
        if flushed is not None and len(turn.output_ids) - flushed >= self.config.flush_tokens:
            self._due.set()

    def untrack(self, turn: TurnRecord) -> None:
        """`turn` has ended; its final write is the caller's."""
        self._turns.pop(turn.id, None)
        self._flushed.pop(turn.id, None)

    def written(self, turn_id: int) -> int | None:
        """How many output tokens of a tracked turn the store holds (None: not tracked)."""
        return self._flushed.get(turn_id)

    async def _run(self) -> None:
        while not self._closing:
            if not self._turns:  # idle: no timer until a turn is tracked
                self._active.clear()
                await self._active.wait()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.flush_interval_s):
                    await self._due.wait()
            self._due.clear()
            await self.flush()

    async def flush(self) -> None:
        """Write every tracked turn's unwritten tokens now (one transaction, in a worker thread)."""
        parts, ends = [], {}
        for turn_id, turn in self._turns.items():
            start, end = self._flushed[turn_id], len(turn.output_ids)
            if end > start:  # slices are copies: the turn goes on growing meanwhile
                ids, lps = turn.output_ids[start:end], turn.output_logprobs[start:end]
                parts.append(OutputPart(turn_id, start, ids, lps, list(turn.weight_segments)))
                ends[turn_id] = end
        if not parts:
            return
        try:
            await asyncio.to_thread(self.store.append_outputs, parts)
        except StoreError:  # logged by the store; the next write tries these tokens again
            return
        self.writes += 1
        for turn_id, end in ends.items():
            if turn_id in self._flushed:
                self._flushed[turn_id] = end

    async def close(self) -> None:
        """Stop: the write in progress finishes (the store closes after), no new one starts."""
        self._closing = True
        self._due.set()
        self._active.set()
        await self._tasks.join()
        await self._tasks.close()
