"""Logprobs for history a harness rewrote, computed in the background.

When a harness changes an earlier assistant message (compaction, a re-serialized tool call), the new
prompt's tokens for it were never sampled, so they have no logprobs. After the turn, one
prompt-logprobs pass on a worker supplies the engine's own logprobs for those spans, recorded as a
``recomputed_logprobs`` event (``recompute_failed`` when it could not be done). The work belongs to
a ``TaskOwner``: ``close`` lets it finish for a grace period at shutdown, then cancels it, and each
cancelled pass says so in its trajectory, all before the pool and the store close.

Each pass is marked pending in the store when it is scheduled, and the mark is dropped with its
outcome (`TrajectoryStore.end_recomputation`). A pass cancelled at shutdown, or lost with a gateway
that died, keeps its mark: ``resume`` (at start-up) schedules them again.

Example::

    recomputer = LogprobRecomputer(store, pool, no_worker_wait=120.0)
    recomputer.resume()                          # at start-up: what a previous gateway left pending
    recomputer.schedule(turn, spans=[(40, 57)])
    await recomputer.close(grace=5.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from core import events as ev
from core.errors import StoreError
from core.tasks import TaskOwner
from engine_pool.face import Engines, Placement
from store import EventRecord, TrajectoryStore, TurnRecord

log = logging.getLogger("belayer.gateway")


class LogprobRecomputer:
    """Runs and owns the background prompt-logprobs passes; see the module docstring."""

    def __init__(self, store: TrajectoryStore, pool: Engines, no_worker_wait: float) -> None:
        self.store = store
        self.pool = pool
        self.no_worker_wait = no_worker_wait
        self._tasks = TaskOwner("logprob-recompute")

    def schedule(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        """Recompute the logprobs of `turn`'s prompt tokens in `spans` (start, end), in the background."""
        self.store.front.post(turn.session_id, self._mark, turn, spans)
        self._tasks.spawn(self._run(turn, spans), f"turn-{turn.id}")

    def _mark(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        with contextlib.suppress(StoreError):  # logged by the store: the pass runs, only not resumable
            self.store.schedule_recomputation(turn, spans)

    def resume(self) -> int:
        """Schedule again the passes the store holds as pending (a previous gateway died, or shut down,
        before they were done); how many. A pass whose turn is gone (its session deleted) is dropped."""
        resumed = 0
        for turn_id, spans in self.store.pending_recomputations():
            turn = self.store.get_turn(turn_id)
            if turn is None:
                self.store.end_recomputation(turn_id, None)
                continue
            self._event(turn, ev.RecomputeResumed(spans))
            self._tasks.spawn(self._run(turn, spans), f"turn-{turn.id}")
            resumed += 1
        if resumed:
            log.info("resuming %d logprob recomputations left pending by the previous gateway", resumed)
        return resumed

    async def _run(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        try:
            prompt = turn.prompt_ids[: max(b for _, b in spans)]
            placement = Placement(turn.session_id, wait=self.no_worker_wait, tokens=len(prompt))
            async with self.pool.lease(placement) as member:
                values = await member.client.prompt_logprobs(prompt)
                worker = member.name
        except asyncio.CancelledError:  # the gateway shuts down: say so in the trajectory, then stop
            error = "cancelled at shutdown (redone at the next start)"
            self._event(turn, ev.RecomputeFailed(spans, error))
            raise
        except Exception as e:
            log.warning("turn %s: logprob recomputation failed: %s", turn.id, e)
            self._end(turn, ev.RecomputeFailed(spans, f"{type(e).__name__}: {e}"))
            return
        runs = [[a, values[a:b]] for a, b in spans]
        self._end(turn, ev.RecomputedLogprobs(runs, worker, sum(b - a for a, b in spans)))

    def _event(self, turn: TurnRecord, event: ev.Payload) -> None:
        record = EventRecord.of(turn.session_id, turn.id, event)
        self.store.front.post(turn.session_id, self.store.add_event, record)

    def _end(self, turn: TurnRecord, event: ev.Payload) -> None:
        """The pass's outcome, and its pending mark dropped, in one write (after the turn's earlier ones)."""
        record = EventRecord.of(turn.session_id, turn.id, event)
        self.store.front.post(turn.session_id, self.store.end_recomputation, turn.id, record)

    async def idle(self) -> None:
        """Wait until no pass is running (tests)."""
        await self._tasks.join()

    async def close(self, grace: float = 5.0) -> None:
        """Give running passes `grace` seconds, then cancel the rest; no new one starts afterwards."""
        try:
            async with asyncio.timeout(grace):
                await self._tasks.join()
        except TimeoutError:
            log.warning("shutdown: cancelling %d logprob recomputations", self._tasks.running)
        await self._tasks.close()
