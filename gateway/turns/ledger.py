"""What is written and announced about a turn: its start (one store transaction with its first event,
the live feed, the observers, in-flight writes), its events, and its end, however it comes.

The turn runner (``gateway.turns.runner``) produces the tokens; `TurnLedger` keeps the record. A turn is
written before the engine is called (status running, prompt ids) and its end is written before the
client is answered, so a client never holds a response whose turn is not on disk. A complete turn's
stored shape, whatever protocol asked for it, is `completed`'s: its response is an assistant message in
OpenAI's chat form.

Every write goes through the store's front (`store.front`), in order per session: awaited for a turn's
start and end; posted, not awaited, for its events and a failed turn's end (on PostgreSQL a commit takes
milliseconds, and a failover storm would otherwise hold up every stream of the process for each).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from core import events as ev
from core.errors import StoreError
from core.tasks import TaskOwner
from core.telemetry import Telemetry
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.parsers import ToolCall
from gateway.turns.inflight import InflightWriter
from gateway.turns.observers import TurnObserver
from gateway.turns.prefix import chain_keys
from gateway.turns.protocol import GenerationRequest, parse_arguments
from store import EventRecord, TurnRecord
from store.base import TURN_ABORTED, TURN_COMPLETE
from store.roles import LedgerStore

T = TypeVar("T")


class TurnLedger:
    """The record of every turn of one gateway: on `store`, the live feed (`telemetry`), `metrics`, the
    turn `observers` (the sandbox manager among them) and the in-flight writer."""

    def __init__(
        self,
        store: LedgerStore,
        inflight: InflightWriter,
        telemetry: Telemetry,
        metrics: GatewayMetrics | None,
        observers: list[TurnObserver],
    ) -> None:
        self.store = store
        self.inflight = inflight
        self.telemetry = telemetry
        self.metrics = metrics
        self.observers = observers
        self._orphans = TaskOwner("orphaned-turns")
        """Ends turns whose request was cancelled while the turn's first write ran (`begin`)."""

    async def begin(self, req: GenerationRequest, prompt_ids: list[int]) -> TurnRecord:
        """The turn stored (running), announced (``turn_started``, the observers) and its in-flight
        writes tracked."""
        turn = await self._timed("begin", self._written_begin(req, prompt_ids))
        req.turn = turn
        self.telemetry.publish(
            ev.TurnStarted(turn.index, turn.branch, len(prompt_ids), req.plan.reused_tokens),
            turn.session_id, turn.id,
        )  # fmt: skip
        for obs in self.observers:
            obs.turn_started(turn)
        self.inflight.track(turn)
        return turn

    async def ending(self, turn: TurnRecord) -> None:
        """The output is complete; its end may wait (``gateway.turns.observers``)."""
        for obs in self.observers:
            await obs.turn_ending(turn)

    async def finish(
        self, turn: TurnRecord, req: GenerationRequest, finish: str, content: str, calls: list[ToolCall],
        reasoning: str, key: int | None, t0: float,
    ) -> None:  # fmt: skip
        """The complete turn, in `completed`'s shape, and its end written (a `StoreError` goes to the
        client: the turn is not on disk)."""
        completed(turn, req, finish, content, calls, reasoning, key, t0)
        try:  # a cancellation meanwhile does not stop the write
            await self._timed("finish", self.store.front.call(turn.session_id, self.store.finish_turn, turn))
        finally:
            self.notify_finished(turn)

    async def _timed(self, op: str, write: Awaitable[T]) -> T:
        """`write`, awaited; its time from its request (a worker thread's queue included) to its commit
        goes to the metrics."""
        t0 = time.monotonic()
        written = await write
        if self.metrics is not None:
            self.metrics.store_write.labels(op).observe(time.monotonic() - t0)
        return written

    async def close(self) -> None:
        await self._orphans.join()  # a few writes: they end before the store closes
        await self._orphans.close()
        await self.inflight.close()

    def _write_begin(self, req: GenerationRequest, prompt_ids: list[int]) -> TurnRecord:
        plan = req.plan

        def first_event(turn: TurnRecord) -> ev.PromptPlan:
            kind: type[ev.PromptPlan] = ev.PrefixReuse if plan.parent else ev.FreshPrompt
            if turn.index > 0 and (plan.parent is None or turn.branch != plan.parent.branch):
                kind = ev.Branch
            parent = plan.parent.index if plan.parent is not None else ev.ABSENT
            return kind(plan.reason, plan.reused_tokens, parent)

        record = TurnRecord(
            session_id=req.session.id,
            prompt_ids=prompt_ids,
            prompt_gen_spans=list(plan.gen_spans),
            parent_id=plan.parent.id if plan.parent else None,
            ext_key=None,
            request=req.request,
            received_at=req.received_at,
        )
        # One transaction: the (ephemeral) session, the turn and its first event. The plan's parent
        # lets the store write the turn as a segment beyond it without reading it again.
        new_session = req.session if req.session.ephemeral else None
        return self.store.begin_turn(record, first_event, new_session, parent=plan.parent)

    def event(self, turn: TurnRecord, event: ev.Payload) -> None:
        """Recorded after the turn's earlier writes and before its end (posted: not awaited)."""
        record = EventRecord.of(turn.session_id, turn.id, event)
        self.store.front.post(turn.session_id, self.store.add_event, record)

    async def _written_begin(self, req: GenerationRequest, prompt_ids: list[int]) -> TurnRecord:
        """`_write_begin`, through the store's front: off the loop for a remote store (a commit is
        milliseconds on PostgreSQL, and every stream of this gateway would wait for it on the event loop).
        A request cancelled while the write runs (its client went away) still has its turn ended,
        ``aborted``, once it is written: none stays running."""
        front = self.store.front
        if not front.remote:
            return self._write_begin(req, prompt_ids)
        written = front.submit(req.session.id, self._write_begin, req, prompt_ids)
        try:
            return await asyncio.shield(written)
        except asyncio.CancelledError:
            self._orphans.spawn(self._abort_when_written(written), "abort-orphaned-turn")
            raise

    async def _abort_when_written(self, written: asyncio.Future[TurnRecord]) -> None:
        with contextlib.suppress(
            Exception
        ):  # the write failed: there is no turn to end (the store logged it)
            turn = await written
            turn.status, turn.error = (
                TURN_ABORTED,
                "the request was cancelled while its turn was being stored",
            )
            await self.store.front.call(turn.session_id, self.store.finish_turn, turn)

    def fail(self, turn: TurnRecord, status: str, error: str, t0: float) -> None:
        """The turn ended without its output complete: recorded with `status` and why, after its earlier
        writes (posted: not awaited, as it is called where the turn's request is being torn down)."""
        turn.status = status
        turn.error = error
        turn.timings["total_ms"] = (time.monotonic() - t0) * 1000
        try:
            self.store.front.post(turn.session_id, self._write_failure, turn, status, error)
        finally:
            self.notify_finished(turn)

    def _write_failure(self, turn: TurnRecord, status: str, error: str) -> None:
        try:
            self.store.finish_turn(turn)
            self.store.add_event(EventRecord.of(turn.session_id, turn.id, ev.TurnFailed(status, error)))
        except StoreError:
            pass  # logged by the store, which keeps the turn's end and writes it later: the first error is the news

    def published(self, turn: TurnRecord, reused_tokens: int, failovers: int, gaps: list[float]) -> None:
        """The turn's end on the live feed, and its token gaps to the metrics (every way a turn ends
        comes here, after its final write: its in-flight writes stop)."""
        self.inflight.untrack(turn)
        self.telemetry.publish(
            ev.TurnFinished(
                index=turn.index, status=turn.status, prompt_tokens=len(turn.prompt_ids),
                reused_tokens=reused_tokens, output_tokens=len(turn.output_ids),
                worker=turn.worker, ttft_ms=turn.timings.get("ttft_ms"),
                total_ms=turn.timings.get("total_ms"), finish_reason=turn.finish_reason,
                failovers=failovers,
            ),
            turn.session_id, turn.id,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.observe_gaps(gaps)

    def notify_finished(self, turn: TurnRecord) -> None:
        for obs in self.observers:
            obs.turn_finished(turn)


def completed(
    turn: TurnRecord, req: GenerationRequest, finish: str, content: str, calls: list[ToolCall],
    reasoning: str, key: int | None, t0: float,
) -> None:  # fmt: skip
    """`turn`, complete, as it is stored: its response (the assistant message, why it ended, and the
    sampling `key` that drew its tokens, ``core.keyed``: a replay needs nothing else), its ext key (the
    chain hash of the request's messages and this one, by which the next request that extends them finds
    this turn: ``gateway.turns.sessions``), its status and its total time since `t0`."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    if req.messages is not None:
        canon = {**message, "tool_calls": [
            {"function": {"name": c.name, "arguments": parse_arguments(c.arguments)}} for c in calls
        ]}  # fmt: skip
        prev = req.message_keys[-1] if req.message_keys else None
        turn.ext_key = chain_keys(req.tools, [canon], prev)[-1]
    turn.response = {"message": message, "finish_reason": finish}
    if key is not None:
        turn.response["sampling"] = {"mode": "keyed", "key": key}
    turn.finish_reason = finish
    turn.status = TURN_COMPLETE
    turn.timings["total_ms"] = (time.monotonic() - t0) * 1000
