"""Mid-stream failover, in one place: a turn's one resumable stream (`TurnStream`). It leases a
worker, guards the worker's stream, classifies any loss of it in one function (`Failover.lost`: a dead
worker, a stall, an engine error, a weight update's cut), decides whether and where the turn goes on,
resubmits the prompt plus every token generated so far, and reports each switch through one callback.
The turn runner (``gateway.turns.runner``) reads the chunks; it never sees a failure it could survive.

A submission's tokens come from a worker through ``stall_guarded`` (``gateway.turns.guard``): a pump
task reads the engine while the turn waits with a deadline, so a worker that stops sending tokens (hung,
not dead) is noticed after ``stall_timeout`` seconds, once a health probe confirms it. A dead worker's
connection error arrives by itself, and a launched worker's exit at once (``engine_pool.workers.exits``: the
pool cuts its streams with a `WorkerExited`). The ``Failure`` kept meanwhile becomes the turn's
``failover`` event once the new worker sends its first token (then the time lost is known).

A weight update cuts the streams still running when its drain time is over (`Preempted`, from the
pool's `Preemption`); they are resubmitted the same way once the update is done, and a
``weight_switch`` event is recorded instead of a ``failover``. A turn's tokens are kept in segments, one
per submission that produced tokens, each with the weight version of the worker that generated it
(`TurnRecord.weight_segments`).

Example::

    stream = TurnStream(failover, turn, params, session, suspicion, tok.eos_ids, report, t0)
    async with contextlib.aclosing(stream.chunks()) as chunks:
        async for chunk in chunks:                      # from one worker, then maybe another
            stream.keep(chunk.token_ids, chunk.logprobs)
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Any

from core import events as ev
from core.errors import (
    EngineError,
    EngineRequestFailed,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    EngineUnreachable,
    QueryOfDeath,
    WorkerExited,
)
from engine_pool.engine.client import SamplingParams, TokenChunk, engine_request_id
from engine_pool.face import Engines, Placement
from engine_pool.member import PoolMember
from gateway.config import FailoverConfig
from gateway.observe.metrics import REQUEST_CLOCK
from gateway.turns.guard import Preempted, stall_guarded
from gateway.turns.protocol import Report
from gateway.turns.quarantine import Publish, Quarantine, Suspicion
from store import SessionRecord, TurnRecord

GREEDY = "greedy: bit-identical"
SAMPLED = "sampled: prefix kept exactly, continuation re-sampled (seeded RNG restarts on the new worker)"
KEYED = "keyed: the same draws as without the failure (core.keyed), up to near ties"


@dataclass(frozen=True, slots=True)
class Failure:
    """A worker lost in the middle of a turn: at which token, which worker, why, and when.

    >>> f = Failure(token_index=3, from_worker="w0", error="reset", at=10.0, last_token_at=9.5)
    >>> f.event(to_worker="w1", now=10.25, sampling=GREEDY).lost_ms
    750.0
    """

    token_index: int
    from_worker: str
    error: str
    at: float
    """When it was noticed (``time.monotonic()``): for a launched worker whose process exited, when the
    pool's watch saw it (`WorkerExited.at`)."""
    last_token_at: float | None
    """When the turn's last token arrived (None: before its first)."""
    cause: str = "dead"
    """``dead`` (connection lost), ``stall`` (no token within the stall timeout), ``error``, or
    ``weights`` (cut by a weight update: `Preempted`)."""
    version: str | None = None
    """The weight version of the turn's tokens so far (None: it had none)."""

    def event(
        self,
        *,
        to_worker: str | None,
        now: float,
        sampling: str,
        resubmitted: float | None = None,
        to_version: str | None = None,
    ) -> ev.Resumed:
        """The ``failover`` event (``weight_switch``: a weight update cut the turn), once the turn
        resumed on `to_worker` (None: it did not; on weight version `to_version`) with its first token
        at `now`, after its resubmission at `resubmitted` (``time.monotonic()`` both).

        ``detect_ms`` and ``lost_ms`` count from the turn's last token. ``noticed_at``,
        ``resubmitted_at`` and ``resumed_at`` are the gateway's ``time.monotonic()`` (Linux's
        ``CLOCK_MONOTONIC``, which every process of the host shares, so a process that killed the worker
        can time the loss from the kill: ``belayer bench recovery``): when the loss was noticed, when
        the resubmission went to its new worker, and when that worker's first token arrived."""
        since = self.last_token_at or self.at
        kind = ev.WeightSwitch if self.cause == "weights" else ev.Failover
        return kind(
            token_index=self.token_index,
            from_worker=self.from_worker,
            error=self.error,
            cause=self.cause,
            to_worker=to_worker,
            detect_ms=round((self.at - since) * 1000, 3),
            lost_ms=round((now - since) * 1000, 3),
            sampling=sampling,
            noticed_at=round(self.at, 6),
            resubmitted_at=round(resubmitted, 6) if resubmitted is not None else None,
            resumed_at=round(now, 6) if to_worker is not None else None,
            from_version=self.version,
            to_version=to_version,
        )


Segment = tuple[int, int, str]
"""(start, end, version): output tokens ``start..end-1`` of a turn, generated on weight `version`."""


def add_tokens(segments: list[Segment], start: int, end: int, version: str, first: bool) -> None:
    """Output tokens ``start..end-1`` came from one submission on weight `version`: its `first` tokens
    open a segment, later ones grow it. A failover or a weight switch is a new submission, so a new
    segment, even on the same version: segments show where each submission took over.

    >>> segs: list[Segment] = []
    >>> add_tokens(segs, 0, 3, "v1", True); add_tokens(segs, 3, 5, "v1", False)   # two chunks
    >>> add_tokens(segs, 5, 6, "v1", True)                                           # a failover
    >>> add_tokens(segs, 6, 9, "v2", True)                                           # a weight switch
    >>> segs
    [(0, 5, 'v1'), (5, 6, 'v1'), (6, 9, 'v2')]
    """
    if first or not segments:
        segments.append((start, end, version))
    else:
        segments[-1] = (segments[-1][0], end, segments[-1][2])


@dataclass(slots=True)
class FailoverState:
    """One turn's failover bookkeeping."""

    failovers: int = 0
    refused_by: list[str] = field(default_factory=list)
    """Healthy workers that answered this turn with an error (a second one makes it the request's)."""
    version: str | None = None
    """The weight version of the turn's latest tokens: a failover stays on it (None: no tokens yet)."""
    keyed: bool = False
    """Its tokens are drawn by keyed sampling (``core.keyed``): a resubmission draws what the lost worker
    would have."""
    suspicion: Suspicion = field(default_factory=Suspicion)
    """Its record with the quarantine (``gateway.turns.quarantine``): deaths it was in flight at."""


LOSSES = (Preempted, EngineUnavailable, EngineTimeout, EngineServerError)
"""What ends a submission early and may be resubmitted: a weight update's cut, a dead or unreachable
worker (its process exited: `WorkerExited`), a stall, a worker that answered with an error."""


class Failover:
    """The failover decisions of every turn, on one pool, under one `FailoverConfig` (``config``; tests
    replace it), with the gateway's `Quarantine` of queries of death."""

    def __init__(self, config: FailoverConfig, pool: Engines, publish: Publish | None = None) -> None:
        self.config = config
        self.pool = pool
        self.quarantine = Quarantine(config.quarantine, publish)

    def isolation(self, state: FailoverState) -> float | None:
        """How long the turn's next submission waits for a worker of its own (None: it needs none)."""
        return self.quarantine.config.isolate_wait_s if state.suspicion.suspect else None

    @property
    def worker_wait(self) -> float:
        """How long a submission waits for a worker: ``no_worker_wait``, none with failover off."""
        return self.config.no_worker_wait if self.config.enabled else 0.0

    def guard(
        self, chunks: AsyncGenerator[TokenChunk, None], member: PoolMember
    ) -> AsyncGenerator[TokenChunk, None]:
        """A worker's stream, guarded against a stall (and cut by a weight update) with failover on."""
        if not self.config.enabled:
            return chunks  # not cut by a weight update either: the update waits for it

        async def confirm() -> bool:
            return await self.pool.confirm_failure(member)

        return stall_guarded(
            chunks, member.name, self.config.stall_timeout, confirm, self.pool.preemption, member.streams
        )

    async def lost(
        self, member: PoolMember, error: EngineError | Preempted, produced: int, last_token_at: float | None,
        state: FailoverState,
    ) -> Failure:  # fmt: skip
        """A submission ended early after `produced` output tokens (any of `LOSSES`): the `Failure` to
        resubmit after, or the error to answer with.

        A weight update's cut (`Preempted`) is resubmitted once the update is done, on the new weights.
        A dead or stalled worker is reported (and fenced, if launched). A worker that *answered* with an
        error is judged by a health probe: if it is healthy, the request is to blame, unless another
        healthy worker serves it; a second refusal makes it the request's error, and no worker is fenced
        for it. A worker that died is judged by the quarantine: the turn may be a suspect (its next
        submission runs alone) or convicted of killing workers (`QueryOfDeath`, raised)."""
        if isinstance(error, Preempted):
            at = time.monotonic()
            return Failure(produced, member.name, str(error), at, last_token_at, "weights", state.version)
        died = True
        if not isinstance(error, EngineServerError):
            self.pool.report_failure(member, error)
        elif not await self.pool.confirm_failure(member):
            died = False
            state.refused_by.append(member.name)
            others = self.pool.pick(Placement(exclude=frozenset(state.refused_by), version=state.version))
            if len(state.refused_by) >= 2 or others is None or not self.config.enabled:
                workers = " and ".join(state.refused_by)
                failed = EngineRequestFailed(
                    f"the engine failed on this request on {workers}, healthy worker(s) ({error})"
                )
                if len(state.refused_by) >= 2:
                    self.quarantine.failed_on_healthy(state.suspicion, failed)
                raise failed from error
        if died and self.config.enabled:
            reached = not isinstance(error, EngineUnreachable)
            if self.quarantine.judge(member.name, state.suspicion, reached) == "convicted":
                raise self.quarantine.convict(state.suspicion) from error
        if not self.config.enabled or state.failovers >= self.config.max_failovers:
            raise error
        state.failovers += 1
        cause = (
            "stall"
            if isinstance(error, EngineTimeout)
            else "error"
            if isinstance(error, EngineServerError)
            else "dead"
        )
        at = error.at if isinstance(error, WorkerExited) else time.monotonic()
        return Failure(produced, member.name, str(error), at, last_token_at, cause, state.version)


class TurnStream:
    """One turn's chunks, from as many workers as it takes (`chunks`). Each submission is leased from
    the pool and guarded (`Failover.guard`); a loss of any kind is classified in `Failover.lost`, which
    raises when the turn cannot go on; else, unless the output was complete already (`finished_before`:
    then `finish` says why it ended), the prompt plus every token generated so far goes to another
    worker, asking for the tokens still missing, and the chunks go on. Each switch is reported through
    `report` once the new worker's first token arrives (then the time lost is known).

    The consumer keeps the tokens it takes of each chunk (`keep`: a stop string may end the output
    inside one): they are the turn's, and what a resubmission sends.

    Example::

        stream = TurnStream(failover, turn, params, session, suspicion, tok.eos_ids, report, t0)
        async with contextlib.aclosing(stream.chunks()) as chunks:
            async for chunk in chunks:
                stream.keep(chunk.token_ids, chunk.logprobs)
    """

    def __init__(
        self, failover: Failover, turn: TurnRecord, params: SamplingParams, session: SessionRecord,
        suspicion: Suspicion, eos_ids: frozenset[int] | set[int], report: Report, t0: float,
    ) -> None:  # fmt: skip
        self.failover, self.pool = failover, failover.pool
        self.turn, self.params, self.session = turn, params, session
        self.eos_ids, self.report, self.t0 = eos_ids, report, t0
        self.state = FailoverState(keyed=params.key is not None, suspicion=suspicion)
        self.finish: str | None = None
        """Why the output ended, when a worker was lost after it was complete (nothing resubmitted)."""
        self.last_token_at: float | None = None
        self.gaps: list[float] = []
        """Inter-token gaps (seconds), for the metrics."""
        self._version = ""
        """The weight version of the submission streaming now."""
        self._fresh = True
        """Its next tokens open a segment (`add_tokens`)."""

    async def chunks(self) -> AsyncGenerator[TokenChunk, None]:
        """Submit, and after each loss resubmit, until the output is complete."""
        previous: Failure | None = None  # the loss the next submission recovers from
        while True:
            lost: Failure | None = None
            alone = self.failover.isolation(self.state)  # a suspect of a worker's death runs alone
            async with (
                self._lease(previous, alone) as member,
                self.failover.quarantine.running(member.name, self.state.suspicion) as slot,
            ):
                self.turn.worker, self._version, self._fresh = member.name, member.weight_version, True
                submitted = time.monotonic()
                self.turn.timings.setdefault("queue_ms", (submitted - self.t0) * 1000)
                stream = self._engine_stream(member)
                clock = REQUEST_CLOCK.get()
                try:
                    async for chunk in stream:
                        arrived = time.monotonic()
                        switched, previous = previous, None  # the new worker's first token: done
                        self.turn.timings.setdefault("ttft_ms", (arrived - self.t0) * 1000)
                        if alone is not None and self._fresh:  # a suspect past its prefill: shared again
                            self.pool.share(member)
                        slot.tokens += len(chunk.token_ids)
                        try:
                            yield chunk
                        finally:  # reported once the token went on to the client (a write, a publish)
                            if switched is not None:
                                self._switched(switched, member.name, submitted, arrived)
                except LOSSES as e:
                    if previous is not None and isinstance(e, Preempted):  # cut before its first token
                        self._switched(previous, member.name, submitted)
                    lost = await self._lost(member, e)
                finally:
                    await stream.aclose()
                    if clock is not None:
                        clock.charge(time.monotonic() - submitted)
            if lost is None:
                return
            if self.finish is not None:  # the output was complete when the worker was lost
                self._switched(lost, None)
                return
            previous = lost

    def keep(self, ids: list[int], logprobs: list[float]) -> None:
        """The tokens taken of the latest chunk: the turn's, in the segment of the worker that sent them."""
        start = len(self.turn.output_ids)
        self.turn.output_ids += ids
        self.turn.output_logprobs += logprobs
        now, n = time.monotonic(), len(ids)
        if self.last_token_at is not None and n:
            self.gaps += [(now - self.last_token_at) / n] * n
        self.last_token_at = now
        if n:
            add_tokens(self.turn.weight_segments, start, start + n, self._version, self._fresh)
            self._fresh, self.state.version = False, self._version

    def _lease(
        self, previous: Failure | None, alone: float | None
    ) -> AbstractAsyncContextManager[PoolMember]:
        """A worker for the next submission. A failover stays on the weight version of the tokens so
        far; a turn cut by a weight update goes on with the new one (a new segment, a weight_switch)."""
        turn, session = self.turn, self.session
        affinity = None if session.ephemeral else session.id  # one-request sessions: not kept
        pinned = self.state.version if previous is None or previous.cause != "weights" else None
        refused = frozenset(self.state.refused_by)
        load = len(turn.prompt_ids) + self.params.max_tokens  # prompt + the most to come
        wait = self.failover.worker_wait
        placement = Placement(
            session_id=affinity, wait=wait, exclude=refused, version=pinned, group=session.group,
            tokens=load, exclusive=alone,
        )  # fmt: skip
        return self.pool.lease(placement)

    def _engine_stream(self, member: PoolMember) -> AsyncGenerator[TokenChunk, None]:
        """The engine's chunks for the turn's prompt plus what it generated so far, asking for the
        tokens still missing (keyed sampling goes on at the turn's next position: the same draws as
        without the loss); with failover on, guarded against a stalled worker. Always streamed, also
        for a non-streamed request: every token reaches the turn as it is decoded, so a weight update's
        cut or a lost worker keeps it (a non-streamed engine answer arrives whole, and a cut threw it
        away)."""
        done = len(self.turn.output_ids)
        remaining = replace(self.params, max_tokens=self.params.max_tokens - done, position=done)
        rid = engine_request_id(self.turn.session_id, self.turn.index)
        prompt = self.turn.prompt_ids + self.turn.output_ids
        return self.failover.guard(
            member.client.generate(prompt, remaining, stream=True, request_id=rid), member
        )

    async def _lost(self, member: PoolMember, error: EngineError | Preempted) -> Failure:
        """`Failover.lost`; a conviction goes into the trajectory, then to the client. Whether the output
        was complete already is taken with the loss (`finish`: then nothing is resubmitted)."""
        produced = len(self.turn.output_ids)
        self.finish = finished_before(self.turn.output_ids, self.eos_ids, self.params.max_tokens)
        try:
            return await self.failover.lost(member, error, produced, self.last_token_at, self.state)
        except QueryOfDeath as convicted:  # not resubmitted: the trajectory says why
            if convicted.event is not None:
                self.report(convicted.event)
            raise

    def _switched(
        self, failure: Failure, to_worker: str | None, resubmitted: float | None = None,
        resumed: float | None = None,
    ) -> None:  # fmt: skip
        """Report a switch: to `to_worker` (None: none was needed), resubmitted to it at `resubmitted`,
        its first token there at `resumed` (now if None)."""
        to_version = self._version if to_worker is not None else None
        event = switch_event(
            self.turn.request, failure, to_worker, to_version, self.state.keyed, resubmitted, resumed
        )
        self.report(event)


def finished_before(output_ids: list[int], eos_ids: frozenset[int] | set[int], max_tokens: int) -> str | None:
    """After a failure in the last token the output may already be complete (EOS, or ``max_tokens``
    filled): its finish reason then, and nothing is resubmitted; else None. (A stop string ends the
    output where the consumer stops reading: no failure comes after it.)"""
    if output_ids and output_ids[-1] in eos_ids:
        return "stop"
    if len(output_ids) >= max_tokens:
        return "length"
    return None


def switch_event(
    request: dict[str, Any],
    failure: Failure,
    to_worker: str | None,
    to_version: str | None,
    keyed: bool = False,
    resubmitted: float | None = None,
    resumed: float | None = None,
) -> ev.Resumed:
    """The event a resumed turn records: ``failover``, or ``weight_switch`` when a weight update cut it;
    its ``sampling`` says what the continuation is (`GREEDY`, `KEYED` or `SAMPLED`); `resumed`: when the
    new worker's first token arrived (now if None)."""
    sampling = KEYED if keyed else GREEDY if request.get("temperature") == 0 else SAMPLED
    now = time.monotonic() if resumed is None else resumed
    return failure.event(
        to_worker=to_worker, now=now, sampling=sampling, resubmitted=resubmitted, to_version=to_version
    )
