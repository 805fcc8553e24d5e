"""One turn, protocol-independent: prompt ids → engine → text deltas and tool calls → trajectory.

The OpenAI and Anthropic front ends build a ``GenerationRequest`` and consume the ``Delta`` and ``Done``
events of ``TurnRunner.run`` (the types are in ``gateway.turns.protocol``), which reads as: prepare (the
prompt ids and sampling parameters; the 4xx errors), begin (the turn is written to the store, status
running, before the engine is called), feed each chunk of the turn's stream to its output, finish (the
turn's end is written, durably, before ``Done`` is yielded), so a client never holds a response whose
turn is not on disk. The stream (``gateway.turns.failover``) survives lost workers: it resubmits the
prompt plus the tokens generated so far to another one, and the client's stream goes on. The output
pipeline (chunks → deltas, finish) is ``gateway.turns.output``; the record, ``gateway.turns.ledger``.

Logprobs for history a harness rewrote are recomputed in the background (``gateway.turns.recompute``). While
a turn streams, its tokens reach the store in batches (``gateway.turns.inflight``), so a crash of the gateway
keeps them: the turn reads as ``interrupted`` with them after a restart.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from core.errors import ContextLengthExceeded, EngineError, InvalidRequest
from core.keyed import SAMPLING_MODES, turn_key
from core.telemetry import Telemetry
from engine_pool.engine.client import SamplingParams
from engine_pool.face import Engines
from gateway.observe.metrics import GatewayMetrics
from gateway.policy.parsers import forced_call_prefix
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.failover import Failover, TurnStream
from gateway.turns.inflight import InflightWriter
from gateway.turns.ledger import TurnLedger
from gateway.turns.observers import TurnObserver
from gateway.turns.output import TurnOutput
from gateway.turns.protocol import Delta, Done, GenerationRequest, TurnSettings
from gateway.turns.recompute import LogprobRecomputer
from store import TrajectoryStore, TurnRecord
from store.base import TURN_ABORTED, TURN_ERROR, TURN_INTERRUPTED


class TurnRunner:
    """Runs one turn against the pool and records it."""

    def __init__(
        self,
        store: TrajectoryStore,
        pool: Engines,
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
        """The turn: prepared, begun (stored), each chunk of its stream fed to its output, finished
        (stored before `Done` is yielded)."""
        prompt_ids, params = self.prepare(req)
        mode = self.sampling(req)
        suspicion = self.failover.quarantine.admit(
            prompt_ids, params, req.session.id
        )  # a known poison: refused
        t0 = time.monotonic()
        turn = await self.ledger.begin(req, prompt_ids)
        if mode == "keyed":
            params = self.keyed(req, turn, params)
        report = functools.partial(self.ledger.event, turn)
        out = TurnOutput.of(self.settings, self.tok, req, params, report)
        stream = TurnStream(self.failover, turn, params, req.session, suspicion, self.tok.eos_ids, report, t0)
        try:
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    delta = out.feed(chunk)  # the tokens it took are the turn's (and a resubmission's)
                    stream.keep(delta.token_ids, delta.logprobs)
                    self.ledger.inflight.progressed(turn)
                    self.telemetry.tokens_streamed += len(delta.token_ids)
                    yield delta
                    if out.stopped:  # a stop string the engine could not see (split by a failover)
                        break
            tail, finish = out.end(stream.finish)
            if tail is not None:
                yield tail
            await self.ledger.ending(turn)
        except EngineError as e:  # EngineRejected among them: answered as the client's error (400)
            self.ledger.fail(turn, TURN_ERROR, str(e), t0)
            self._published(turn, req, stream)
            raise
        except BaseException as e:  # client went away (cancelled) or a bug: keep what was generated
            if self.interrupting and not isinstance(e, Exception):  # cancelled by the shutdown deadline
                self.ledger.fail(
                    turn, TURN_INTERRUPTED, "the gateway shut down (its grace period ran out)", t0
                )
            else:
                self.ledger.fail(turn, TURN_ABORTED, repr(e), t0)
            self._published(turn, req, stream)
            raise
        yield await self._finish(req, turn, out, stream, finish, t0)

    async def _finish(
        self, req: GenerationRequest, turn: TurnRecord, out: TurnOutput, stream: TurnStream, finish: str,
        t0: float,
    ) -> Done:  # fmt: skip
        """The complete turn, stored (in ``gateway.turns.ledger.completed``'s shape) and announced."""
        self.failover.quarantine.cleared(stream.state.suspicion)
        content, calls, reasoning = "".join(out.content), out.parser.calls, "".join(out.reasoning)
        try:
            await self.ledger.finish(turn, req, finish, content, calls, reasoning, stream.params.key, t0)
        finally:
            self._published(turn, req, stream)
        if req.plan.rewritten:
            self.recomputer.schedule(turn, req.plan.rewritten)
        prompt, completion = len(turn.prompt_ids), len(turn.output_ids)
        done = Done(turn, finish, content, calls, prompt, completion, reasoning=reasoning)
        done.stop_sequence = out.trimmer.matched
        return done

    async def idle(self) -> None:
        """Wait for background logprob recomputations (tests)."""
        await self.recomputer.idle()

    async def close(self, grace: float = 5.0) -> None:
        """At shutdown, before the pool and the store close: recomputations get `grace` seconds."""
        await self.recomputer.close(grace)
        await self.ledger.close()

    def _published(self, turn: TurnRecord, req: GenerationRequest, stream: TurnStream) -> None:
        self.ledger.published(turn, req.plan.reused_tokens, stream.state.failovers, stream.gaps)
