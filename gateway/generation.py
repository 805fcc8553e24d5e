"""One turn, protocol-independent: prompt ids → engine → text deltas and tool calls → trajectory.

Both OpenAI and (later) Anthropic front ends build a ``GenerationRequest`` and consume the ``Delta`` and
``Done`` events of ``TurnRunner.run``. The turn is written to the store before the engine is called
(status running, prompt ids) and finished, durably, before ``Done`` is yielded, so a client never holds a
response whose turn is not on disk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from belayer.errors import ContextLengthExceeded, EngineError, EngineRejected, InvalidRequest
from engine_pool.client import SamplingParams
from engine_pool.pool import EnginePool, PoolMember
from gateway.observers import TurnObserver
from gateway.parsing import ContentDelta, HermesToolParser, MalformedToolCall, StopTrimmer, ToolCall
from gateway.sessions import PromptPlan, chain_keys
from gateway.store import EventRecord, SessionRecord, TrajectoryStore, TurnRecord
from gateway.store.base import TURN_ABORTED, TURN_COMPLETE, TURN_ERROR
from gateway.tokenization import ChatTokenizer


def parse_arguments(arguments: str | dict[str, Any]) -> Any:
    """Tool-call arguments as an object when they are JSON (how the template renders them)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


@dataclass(slots=True)
class GenerationRequest:
    session: SessionRecord
    plan: PromptPlan
    params: SamplingParams
    request: dict[str, Any]
    received_at: float
    max_tokens: int | None = None
    messages: list[dict[str, Any]] | None = None  # None for raw completions
    tools: list[dict[str, Any]] | None = None
    message_keys: list[str] = field(default_factory=list)
    forced_prefix: str = ""  # text the assistant turn is forced to start with (tool_choice)
    parse_tools: bool = True
    stream: bool = True  # stream from the engine (the client streams, or wants per-token progress)


@dataclass(slots=True)
class Delta:
    """What one engine event added: visible text, finished tool calls, and the raw tokens."""

    content: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


@dataclass(slots=True)
class Done:
    turn: TurnRecord
    finish_reason: str
    content: str
    tool_calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int


class TurnRunner:
    """Runs one turn against the pool and records it."""

    def __init__(
        self,
        store: TrajectoryStore,
        pool: EnginePool,
        tokenizer: ChatTokenizer,
        default_max_tokens: int | None = None,
        observers: list[TurnObserver] | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.tok = tokenizer
        self.default_max_tokens = default_max_tokens
        self.observers = observers if observers is not None else []

    def _budget(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.pool.max_model_len
        if not limit:
            return max_tokens or self.default_max_tokens or 16
        if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
            asked = f" + {max_tokens} completion tokens" if max_tokens is not None else ""
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len} prompt tokens{asked}. Please reduce the length of the messages or completion.",
                param="messages",
            )
        room = limit - prompt_len
        return min(x for x in (max_tokens, self.default_max_tokens, room) if x is not None)

    def prepare(self, req: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """Final prompt ids and sampling parameters; raises the 4xx errors before anything is stored."""
        prompt_ids = req.plan.prompt_ids + (self.tok.encode(req.forced_prefix) if req.forced_prefix else [])
        bad = next((t for t in prompt_ids if t < 0 or t >= self.tok.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (0..{self.tok.vocab_size - 1})", "prompt"
            )
        return prompt_ids, replace(req.params, max_tokens=self._budget(len(prompt_ids), req.max_tokens))

    def _begin(self, req: GenerationRequest, prompt_ids: list[int]) -> TurnRecord:
        plan = req.plan

        def first_event(turn: TurnRecord) -> tuple[str, dict[str, Any]]:
            kind = "prefix_reuse" if plan.parent else "fresh_prompt"
            data: dict[str, Any] = {"reason": plan.reason, "reused_tokens": plan.reused_tokens}
            if plan.parent is not None:
                data["parent_turn"] = plan.parent.index
            if turn.index > 0 and (plan.parent is None or turn.branch != plan.parent.branch):
                kind = "branch"
            return kind, data

        record = TurnRecord(
            session_id=req.session.id,
            prompt_ids=prompt_ids,
            prompt_gen_spans=list(plan.gen_spans),
            parent_id=plan.parent.id if plan.parent else None,
            ext_key=None,
            request=req.request,
            received_at=req.received_at,
        )
        # One transaction: the (ephemeral) session, the turn and its first event.
        return self.store.begin_turn(record, first_event, req.session if req.session.ephemeral else None)

    def _event(self, turn: TurnRecord, kind: str, data: dict[str, Any]) -> None:
        self.store.add_event(EventRecord(turn.session_id, turn.id, time.time(), kind, data))

    async def run(self, req: GenerationRequest) -> AsyncGenerator[Delta | Done, None]:
        prompt_ids, params = self.prepare(req)
        t0 = time.monotonic()
        turn = self._begin(req, prompt_ids)
        for obs in self.observers:
            obs.turn_started(turn)
        detok = self.tok.detokenizer()
        trimmer = StopTrimmer(params.stop)
        parser = HermesToolParser(enabled=req.parse_tools)
        parser.feed(req.forced_prefix)
        content: list[str] = []
        finish = "stop"
        member: PoolMember | None = None
        try:
            async with self.pool.lease(req.session.id) as member:
                turn.worker = member.name
                turn.timings["queue_ms"] = (time.monotonic() - t0) * 1000
                async for chunk in member.client.generate(prompt_ids, params, stream=req.stream):
                    if chunk.token_ids and "ttft_ms" not in turn.timings:
                        turn.timings["ttft_ms"] = (time.monotonic() - t0) * 1000
                    turn.output_ids += chunk.token_ids
                    turn.output_logprobs += chunk.logprobs
                    text = trimmer.feed("".join(detok.step(t) for t in chunk.token_ids))
                    finish = chunk.finish_reason or finish
                    delta = self._delta(turn, parser.feed(text), content)
                    delta.token_ids, delta.logprobs, delta.top_logprobs = (
                        chunk.token_ids,
                        chunk.logprobs,
                        chunk.top_logprobs,
                    )
                    yield delta
            tail = self._delta(turn, parser.feed(trimmer.finish()) + parser.finish(), content)
            if tail.content or tail.tool_calls:
                yield tail
        except EngineRejected as e:
            self._fail(turn, TURN_ERROR, str(e), t0)
            raise InvalidRequest(f"the engine rejected the request: {e}", code="engine_rejected") from e
        except EngineError as e:
            if member is not None:
                self.pool.report_failure(member, e)
            self._fail(turn, TURN_ERROR, str(e), t0)
            raise
        except BaseException as e:  # client went away (cancelled) or a bug: keep what was generated
            self._fail(turn, TURN_ABORTED, repr(e), t0)
            raise
        finish = "tool_calls" if parser.calls and finish == "stop" else finish
        yield self._complete(req, turn, finish, "".join(content), parser.calls, t0)

    def _delta(self, turn: TurnRecord, events: list[Any], content: list[str]) -> Delta:
        delta = Delta("", [], [], [], [])
        for ev in events:
            if isinstance(ev, ContentDelta):
                delta.content += ev.text
            elif isinstance(ev, ToolCall):
                delta.tool_calls.append(ev)
            elif isinstance(ev, MalformedToolCall):
                self._event(turn, "tool_call_parse_error", {"raw": ev.raw, "reason": ev.reason})
        content.append(delta.content)
        return delta

    def _fail(self, turn: TurnRecord, status: str, error: str, t0: float) -> None:
        turn.status = status
        turn.error = error
        turn.timings["total_ms"] = (time.monotonic() - t0) * 1000
        self.store.finish_turn(turn)
        self._event(turn, "turn_failed", {"status": status, "error": error})
        self._notify_finished(turn)

    def _notify_finished(self, turn: TurnRecord) -> None:
        for obs in self.observers:
            obs.turn_finished(turn)

    def _complete(
        self,
        req: GenerationRequest,
        turn: TurnRecord,
        finish: str,
        content: str,
        calls: list[ToolCall],
        t0: float,
    ) -> Done:
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
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
        self.store.finish_turn(turn)
        self._notify_finished(turn)
        return Done(turn, finish, content, calls, len(turn.prompt_ids), len(turn.output_ids))
