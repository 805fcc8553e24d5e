"""One turn, protocol-independent: prompt ids → engine → text deltas and tool calls → trajectory.

The OpenAI and Anthropic front ends build a ``GenerationRequest`` and consume the ``Delta`` and ``Done``
events of ``TurnRunner.run`` (the types are in ``gateway.turns.protocol``). The turn is written to the
store before the engine is called (status running, prompt ids) and finished, durably, before ``Done`` is
yielded (the record is kept by ``gateway.turns.ledger``), so a client never holds a
response whose turn is not on disk. When a worker is lost mid-turn, the runner resubmits the prompt plus
the tokens generated so far to another worker (``gateway.turns.failover``); the client's stream goes on.

Logprobs for history a harness rewrote are recomputed in the background (``gateway.turns.recompute``). While
a turn streams, its tokens reach the store in batches (``gateway.turns.inflight``), so a crash of the gateway
keeps them: the turn reads as ``interrupted`` with them after a restart.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from core.errors import (
    ContextLengthExceeded,
    EngineError,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    QueryOfDeath,
)
from core.events import ToolCallParseError
from core.keyed import SAMPLING_MODES, turn_key
from core.telemetry import Telemetry
from engine_pool.client import SamplingParams, TokenChunk, engine_request_id
from engine_pool.pool import EnginePool, PoolMember
from gateway.observe.metrics import REQUEST_CLOCK, GatewayMetrics
from gateway.policy.parsers import (
    SPECIAL_TAGS,
    ContentDelta,
    MalformedToolCall,
    ReasoningDelta,
    ReasoningParser,
    ToolCall,
    ToolParser,
    forced_call_prefix,
    make_reasoning_parser,
    make_tool_parser,
)
from gateway.policy.streaming import StopTrimmer
from gateway.policy.tokenization import ChatTokenizer, IncrementalDetokenizer
from gateway.turns.failover import (
    Failover,
    FailoverState,
    Failure,
    Preempted,
    add_tokens,
    finished_before,
    switch_event,
)
from gateway.turns.inflight import InflightWriter
from gateway.turns.ledger import TurnLedger
from gateway.turns.observers import TurnObserver
from gateway.turns.protocol import Delta, Done, GenerationRequest, TurnSettings, parse_arguments
from gateway.turns.recompute import LogprobRecomputer
from gateway.turns.sessions import chain_keys
from store import TrajectoryStore, TurnRecord
from store.base import TURN_ABORTED, TURN_COMPLETE, TURN_ERROR, TURN_INTERRUPTED

log = logging.getLogger("belayer.gateway")


@dataclass(slots=True)
class _OutputState:
    """Per-turn output pipeline (detokenizer → stop strings → reasoning parser → tool parser) and
    failover bookkeeping (`FailoverState`)."""

    detok: IncrementalDetokenizer
    trimmer: StopTrimmer
    parser: ToolParser
    reasoner: ReasoningParser | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish: str = "stop"
    last_token_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    """Inter-token gaps (seconds), for the metrics."""
    fo: FailoverState = field(default_factory=FailoverState)

    def parse(self, text: str, final: bool = False) -> list[Any]:
        """The parsers' events for the next visible text (``final``: and what they held back)."""
        if self.reasoner is None:
            return self.parser.feed(text) + (self.parser.finish() if final else [])
        events: list[Any] = []
        for ev in self.reasoner.feed(text) + (self.reasoner.finish() if final else []):
            events += [ev] if isinstance(ev, ReasoningDelta) else self.parser.feed(ev.text)
        return events + (self.parser.finish() if final else [])


class TurnRunner:
    """Runs one turn against the pool and records it."""

    def __init__(
        self,
        store: TrajectoryStore,
        pool: EnginePool,
        tokenizer: ChatTokenizer,
        settings: TurnSettings | None = None,
        *,
        observers: list[TurnObserver] | None = None,
        telemetry: Telemetry | None = None,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.settings = settings = settings or TurnSettings()
        self.telemetry = telemetry or Telemetry()
        """Where each turn's start and end are published (``turn_started``, ``turn_finished``)."""
        self.failover = Failover(settings.failover, pool, self.telemetry.publish)
        self.pool = pool
        self.tok = tokenizer
        self.recomputer = LogprobRecomputer(store, pool, settings.failover.no_worker_wait)
        self.ledger = TurnLedger(
            store, InflightWriter(store, settings.inflight), self.telemetry, metrics, observers or []
        )
        """The store, the metrics and the turn observers are the ledger's: the runner only produces tokens."""
        self.interrupting = False
        """Set by the server (``gateway.serve.server``) when its shutdown deadline passes, just before it
        cancels the requests still running: a turn cancelled then is recorded ``interrupted`` (with its
        tokens so far), not ``aborted`` as when its client goes away."""

    def _budget(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.pool.max_model_len
        if not limit:
            return max_tokens or self.settings.default_max_tokens or 16
        if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
            asked = f" + {max_tokens} completion tokens" if max_tokens is not None else ""
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len} prompt tokens{asked}. Please reduce the length of the messages or completion.",
                param="messages",
            )
        room = limit - prompt_len
        wanted = max_tokens if max_tokens is not None else self.settings.default_max_tokens
        return min(x for x in (wanted, self.settings.max_tokens_cap, room) if x is not None)

    def prepare(self, req: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """Final prompt ids and sampling parameters; raises the 4xx errors before anything is stored."""
        req.forced_prefix = forced_call_prefix(
            self.settings.tool_call_parser, req.forced_prefix
        )  # the family's own
        prompt_ids = req.plan.prompt_ids + (self.tok.encode(req.forced_prefix) if req.forced_prefix else [])
        budget = self._budget(len(prompt_ids), req.max_tokens)  # first: it is cheap for any length
        # Client-supplied token ids (raw completions) may be anything; templated prompts are ours.
        raw_ids = prompt_ids if req.messages is None else []
        bad = next((t for t in raw_ids if t < 0 or t >= self.tok.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (0..{self.tok.vocab_size - 1})", "prompt"
            )
        return prompt_ids, replace(req.params, max_tokens=budget)

    def sampling(self, req: GenerationRequest) -> str:
        """The request's sampling (its ``sampling`` field, else the gateway's): 400 for a bad one."""
        mode = req.request.get("sampling", self.settings.sampling)
        if mode not in SAMPLING_MODES:
            raise InvalidRequest(
                f"'sampling' must be one of {', '.join(SAMPLING_MODES)}, not {mode!r}", "sampling"
            )
        if mode == "keyed" and not self.settings.keyed_workers:
            raise InvalidRequest(
                "this gateway's vLLM workers do not load the keyed sampler: restart it with "
                "`belayer serve --sampling keyed` (or send 'sampling': 'engine')",
                "sampling",
            )
        params = req.params
        if mode == "keyed" and (params.presence_penalty or params.frequency_penalty):
            raise InvalidRequest(
                "keyed sampling draws from the policy's own distribution: remove presence_penalty and "
                "frequency_penalty, or send 'sampling': 'engine'",
                "presence_penalty" if params.presence_penalty else "frequency_penalty",
            )
        return str(mode)

    @staticmethod
    def keyed(req: GenerationRequest, turn: TurnRecord, params: SamplingParams) -> SamplingParams:
        """`params` with the turn's key (``core.keyed.turn_key``); the stored response names it."""
        key = turn_key(turn.index, req.session.id, req.session.seed, params.seed)
        return replace(params, key=key, seed=None)

    async def run(self, req: GenerationRequest) -> AsyncGenerator[Delta | Done, None]:
        prompt_ids, params = self.prepare(req)
        mode = self.sampling(req)
        suspicion = self.failover.quarantine.admit(
            prompt_ids, params, req.session.id
        )  # a known poison: refused
        t0 = time.monotonic()
        turn = await self.ledger.begin(req, prompt_ids)
        if mode == "keyed":
            params = self.keyed(req, turn, params)
        st = _OutputState(
            self.tok.detokenizer(
                special=self.settings.tool_call_parser in SPECIAL_TAGS and req.messages is not None
            ),
            StopTrimmer(params.stop),
            make_tool_parser(self.settings.tool_call_parser, req.tools, req.parse_tools),
            # chat turns only (raw completions are raw text); a forced tool call starts with no reasoning
            make_reasoning_parser(self.settings.reasoning_parser if req.messages is not None else None)
            if not req.forced_prefix
            else None,
        )
        st.parser.feed(req.forced_prefix)
        st.fo.suspicion, st.fo.keyed = suspicion, params.key is not None
        try:
            async with contextlib.aclosing(self._generate(req, turn, params, st, t0)) as deltas:
                async for delta in deltas:
                    yield delta
            await self.ledger.ending(turn)
        except EngineError as e:  # EngineRejected among them: answered as the client's error (400)
            self.ledger.fail(turn, TURN_ERROR, str(e), t0)
            self._published(turn, req, st)
            raise
        except BaseException as e:  # client went away (cancelled) or a bug: keep what was generated
            if self.interrupting and not isinstance(e, Exception):  # cancelled by the shutdown deadline
                self.ledger.fail(
                    turn, TURN_INTERRUPTED, "the gateway shut down (its grace period ran out)", t0
                )
            else:
                self.ledger.fail(turn, TURN_ABORTED, repr(e), t0)
            self._published(turn, req, st)
            raise
        finish = "stop" if st.trimmer.stopped else st.finish
        finish = "tool_calls" if st.parser.calls and finish == "stop" else finish
        self.failover.quarantine.cleared(st.fo.suspicion)
        try:
            done = self._complete(
                req, turn, finish, "".join(st.content), st.parser.calls, t0, "".join(st.reasoning)
            )
            if params.key is not None:  # what drew its tokens (core.keyed): a replay needs nothing else
                turn.response = {**(turn.response or {}), "sampling": {"mode": "keyed", "key": params.key}}
            await self.ledger.finish(turn)
        finally:
            self._published(turn, req, st)
        if req.plan.rewritten:
            self.recomputer.schedule(turn, req.plan.rewritten)
        done.stop_sequence = st.trimmer.matched
        yield done

    async def _generate(
        self, req: GenerationRequest, turn: TurnRecord, params: SamplingParams, st: _OutputState, t0: float
    ) -> AsyncGenerator[Delta, None]:
        """Submit to a worker and, after each lost worker, resubmit prompt + every token so far to
        another one, until the turn is complete; then the parsers' tail."""
        failure: Failure | None = None
        while not self._done_after_failure(turn, st, params, failure):
            lost = None
            async with contextlib.aclosing(self._submit(req, turn, params, st, t0, failure)) as items:
                async for item in items:
                    if isinstance(item, Failure):
                        lost = item
                    else:
                        yield item
            failure = lost
            if failure is None:
                break
        if failure is not None:  # the output was complete when the worker was lost
            self._record_failover(turn, st, failure, None)
        tail = self._delta(turn, st.parse(st.trimmer.finish(), final=True), st)
        if tail.content or tail.tool_calls or tail.reasoning:
            yield tail

    async def _submit(
        self,
        req: GenerationRequest,
        turn: TurnRecord,
        params: SamplingParams,
        st: _OutputState,
        t0: float,
        previous: Failure | None,
    ) -> AsyncGenerator[Delta | Failure, None]:
        """One submission to one leased worker, asking for the tokens still missing. Yields the deltas,
        then a `Failure` when the worker was lost and another may take over (else the error is raised).
        `previous`, the failure this submission recovers from, is recorded at its first token."""
        # keyed sampling goes on at the turn's next position: the same draws as without the failure
        remaining = replace(
            params, max_tokens=params.max_tokens - len(turn.output_ids), position=len(turn.output_ids)
        )
        affinity = None if req.session.ephemeral else req.session.id  # one-request sessions: not kept
        wait = self.failover.worker_wait
        # A failover stays on the weight version of the tokens so far; a turn cut by a weight update
        # goes on with the new one (recorded: a new segment and a weight_switch event).
        pinned = st.fo.version if previous is None or previous.cause != "weights" else None
        refused = frozenset(st.fo.refused_by)
        load = len(turn.prompt_ids) + len(turn.output_ids) + remaining.max_tokens  # prompt + the most to come
        alone = self.failover.isolation(st.fo)  # a suspect of a worker's death runs on a worker of its own
        lease = self.pool.lease(affinity, wait, refused, pinned, req.session.group, load, alone)
        async with lease as member, self.failover.quarantine.running(member.name, st.fo.suspicion) as slot:
            turn.worker = member.name
            version = member.weight_version
            submitted = time.monotonic()
            turn.timings.setdefault("queue_ms", (submitted - t0) * 1000)
            stream = self._engine_stream(member, turn, remaining)
            clock = REQUEST_CLOCK.get()
            first = True
            try:
                async for chunk in stream:
                    if previous is not None:
                        self._record_failover(turn, st, previous, member.name, version, submitted)
                        previous = None
                    turn.timings.setdefault("ttft_ms", (time.monotonic() - t0) * 1000)
                    if alone is not None and first:  # a suspect past its prefill: the worker is shared again
                        self.pool.share(member)
                    start = len(turn.output_ids)
                    slot.tokens += len(chunk.token_ids)
                    delta = self._consume(turn, chunk, st)
                    if len(turn.output_ids) > start:
                        add_tokens(turn.weight_segments, start, len(turn.output_ids), version, first)
                        first, st.fo.version = False, version
                    yield delta
                    if st.trimmer.stopped:  # a stop string the engine could not see (split by a failover)
                        break
            except Preempted as e:
                if previous is not None:  # the failover that brought the turn here, before the cut
                    self._record_failover(turn, st, previous, member.name, version, submitted)
                now = time.monotonic()
                yield Failure(
                    len(turn.output_ids), member.name, str(e), now, st.last_token_at, "weights", st.fo.version
                )
            except (EngineUnavailable, EngineTimeout, EngineServerError) as e:
                try:
                    failure = await self.failover.lost(
                        member, e, len(turn.output_ids), st.last_token_at, st.fo
                    )
                except QueryOfDeath as convicted:  # not resubmitted: the trajectory says why
                    if convicted.event is not None:
                        self.ledger.event(turn, convicted.event)
                    raise
                yield failure
            finally:
                await stream.aclose()
                if clock is not None:
                    clock.charge(time.monotonic() - submitted)

    def _done_after_failure(
        self, turn: TurnRecord, st: _OutputState, params: SamplingParams, failure: Failure | None
    ) -> bool:
        """Before a (re)submission: is the turn already complete (`finished_before`)?"""
        if failure is None:
            return False
        finish = finished_before(turn.output_ids, st.trimmer.stopped, self.tok.eos_ids, params.max_tokens)
        st.finish = finish or st.finish
        return finish is not None

    def _engine_stream(
        self, member: PoolMember, turn: TurnRecord, params: SamplingParams
    ) -> AsyncGenerator[TokenChunk, None]:
        """The engine's chunks for the turn's prompt plus what it generated so far (a resubmission after
        a failover); with failover on, guarded against a stalled worker. Always streamed, also for a
        non-streamed request: every token reaches the turn as it is decoded, so a weight update's cut
        or a lost worker keeps it (a non-streamed engine answer arrives whole, and a cut threw it away)."""
        rid = engine_request_id(turn.session_id, turn.index)
        prompt = turn.prompt_ids + turn.output_ids
        return self.failover.guard(
            member.client.generate(prompt, params, stream=True, request_id=rid), member
        )

    def _consume(self, turn: TurnRecord, chunk: TokenChunk, st: _OutputState) -> Delta:
        """Record a chunk's tokens and turn them into visible text. Tokens are taken one at a time so
        that a stop string ends the output at exactly the token the engine itself would stop at."""
        pieces = []
        n = 0
        for t in chunk.token_ids:
            n += 1
            pieces.append(st.trimmer.feed(st.detok.step(t)))
            if st.trimmer.stopped:
                break
        ids, lps = chunk.token_ids[:n], chunk.logprobs[:n]
        turn.output_ids += ids
        turn.output_logprobs += lps
        self.ledger.inflight.progressed(turn)
        self.telemetry.tokens_streamed += n
        now = time.monotonic()
        if st.last_token_at is not None and n:
            st.gaps += [(now - st.last_token_at) / n] * n
        st.last_token_at = now
        st.finish = chunk.finish_reason or st.finish
        delta = self._delta(turn, st.parse("".join(pieces)), st)
        delta.token_ids, delta.logprobs, delta.top_logprobs = ids, lps, chunk.top_logprobs[:n]
        return delta

    def _record_failover(
        self,
        turn: TurnRecord,
        st: _OutputState,
        failure: Failure,
        to_worker: str | None,
        to_version: str | None = None,
        resubmitted: float | None = None,
    ) -> None:
        """A ``failover`` event, or a ``weight_switch`` when a weight update cut the turn (`resubmitted`:
        when the resubmission went to `to_worker`, ``time.monotonic()``)."""
        event = switch_event(turn.request, failure, to_worker, to_version, st.fo.keyed, resubmitted)
        self.ledger.event(turn, event)

    def _delta(self, turn: TurnRecord, events: list[Any], st: _OutputState) -> Delta:
        delta = Delta("", [], [], [], [])
        for ev in events:
            if isinstance(ev, ContentDelta):
                delta.content += ev.text
            elif isinstance(ev, ReasoningDelta):
                delta.reasoning += ev.text
            elif isinstance(ev, ToolCall):
                delta.tool_calls.append(ev)
            elif isinstance(ev, MalformedToolCall):
                self.ledger.event(turn, ToolCallParseError(ev.raw, ev.reason))
        st.content.append(delta.content)
        st.reasoning.append(delta.reasoning)
        return delta

    async def idle(self) -> None:
        """Wait for background logprob recomputations (tests)."""
        await self.recomputer.idle()

    async def close(self, grace: float = 5.0) -> None:
        """At shutdown, before the pool and the store close: recomputations get `grace` seconds."""
        await self.recomputer.close(grace)
        await self.ledger.close()

    def _published(self, turn: TurnRecord, req: GenerationRequest, st: _OutputState) -> None:
        self.ledger.published(turn, req.plan.reused_tokens, st.fo.failovers, st.gaps)

    def _complete(
        self,
        req: GenerationRequest,
        turn: TurnRecord,
        finish: str,
        content: str,
        calls: list[ToolCall],
        t0: float,
        reasoning: str = "",
    ) -> Done:
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
        turn.finish_reason = finish
        turn.status = TURN_COMPLETE
        turn.timings["total_ms"] = (time.monotonic() - t0) * 1000
        return Done(
            turn, finish, content, calls, len(turn.prompt_ids), len(turn.output_ids), reasoning=reasoning
        )
