"""Mid-stream failover, in one place: noticing that a worker is lost, deciding what follows, and
recording that it happened. `Failover` holds the decisions the turn runner asks for (guard a stream,
judge a lost submission, say whether the output was already complete, name the event); the runner keeps
the loop that resubmits.

A turn's tokens come from a worker through ``stall_guarded``: a pump task reads the engine while the
turn waits with a deadline, so a worker that stops sending tokens (hung, not dead) is noticed after
``stall_timeout`` seconds, once a health probe confirms it. A dead worker's connection error arrives by
itself. Either way the turn runner resubmits the prompt plus every token generated so far to another
worker; the ``Failure`` it keeps meanwhile becomes the turn's ``failover`` event once the new worker
sends its first token (then the time lost is known).

A weight update cuts the streams still running when its drain time is over (`Preempted`, from the
pool's `Preemption`); the runner resubmits them the same way once the update is done, and records a
``weight_switch`` event instead of a ``failover``. A turn's tokens are kept in segments, one per
submission that produced tokens, each with the weight version of the worker that generated it
(`TurnRecord.weight_segments`).

Example::

    failure = Failure(token_index=12, from_worker="worker-0", error="reset", at=now, last_token_at=t)
    store.add_event(EventRecord.of(sid, turn.id,
                                   failure.event(to_worker="worker-1", now=time.monotonic(), sampling=GREEDY)))
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from core import events as ev
from core.errors import (
    BelayerError,
    EngineError,
    EngineRequestFailed,
    EngineServerError,
    EngineTimeout,
    EngineUnreachable,
    WorkerExited,
)
from engine_pool.client import TokenChunk, merge_chunks
from engine_pool.pool import EnginePool, PoolMember, Preemption
from gateway.config import FailoverConfig
from gateway.turns.quarantine import Publish, Quarantine, Suspicion

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
        """The worker's process exited (``engine_pool.exits``): the stream fails now, after the chunks
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


class Failover:
    """The failover decisions of every turn, on one pool, under one `FailoverConfig` (``config``; tests
    replace it), with the gateway's `Quarantine` of queries of death."""

    def __init__(self, config: FailoverConfig, pool: EnginePool, publish: Publish | None = None) -> None:
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
        self, member: PoolMember, error: EngineError, produced: int, last_token_at: float | None,
        state: FailoverState,
    ) -> Failure:  # fmt: skip
        """A submission failed after `produced` output tokens: the `Failure` to resubmit after, or the
        error to answer with.

        A dead or stalled worker is reported (and fenced, if launched). A worker that *answered* with an
        error is judged by a health probe: if it is healthy, the request is to blame, unless another
        healthy worker serves it; a second refusal makes it the request's error, and no worker is fenced
        for it. A worker that died is judged by the quarantine: the turn may be a suspect (its next
        submission runs alone) or convicted of killing workers (`QueryOfDeath`, raised)."""
        died = True
        if not isinstance(error, EngineServerError):
            self.pool.report_failure(member, error)
        elif not await self.pool.confirm_failure(member):
            died = False
            state.refused_by.append(member.name)
            others = self.pool.pick(None, frozenset(state.refused_by), state.version)
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


def finished_before(
    output_ids: list[int], stopped: bool, eos_ids: frozenset[int] | set[int], max_tokens: int
) -> str | None:
    """After a failure in the last token the output may already be complete (a stop string, EOS, or
    ``max_tokens`` filled): its finish reason then, and nothing is resubmitted; else None."""
    if stopped or (output_ids and output_ids[-1] in eos_ids):
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
) -> ev.Resumed:
    """The event a resumed turn records: ``failover``, or ``weight_switch`` when a weight update cut it;
    its ``sampling`` says what the continuation is (`GREEDY`, `KEYED` or `SAMPLED`)."""
    sampling = KEYED if keyed else GREEDY if request.get("temperature") == 0 else SAMPLED
    now = time.monotonic()
    return failure.event(
        to_worker=to_worker, now=now, sampling=sampling, resubmitted=resubmitted, to_version=to_version
    )
