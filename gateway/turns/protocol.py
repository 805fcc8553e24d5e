"""What a protocol's front end and the turn runner exchange, and the runner's settings.

The OpenAI and Anthropic front ends (``gateway.api``) build a `GenerationRequest` and consume the `Delta`
and `Done` events of ``TurnRunner.run`` (``gateway.turns.runner``); they import these types from here, not
the runner.

Example::

    req = GenerationRequest(session, plan, params, request=body, received_at=time.time(), messages=msgs)
    async for event in runner.run(req):
        if isinstance(event, Delta): ...       # visible text, finished tool calls, raw tokens
        else: ...                              # Done: the turn, stored, and its totals
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core import events
from engine_pool.engine.client import SamplingParams
from gateway.config import FailoverConfig, GatewayConfig, InflightConfig
from gateway.policy.parsers import ToolCall
from gateway.turns.prefix import PromptPlan
from store import SessionRecord, TurnRecord

Report = Callable[[events.Payload], None]
"""Where a turn's events go as it runs (``TurnLedger.event``, bound to the turn): its switches to other
workers, a conviction as a query of death, a malformed tool call."""


@dataclass(frozen=True, slots=True)
class TurnSettings:
    """Every setting of the turn runner, from the gateway's configuration (`of`)."""

    default_max_tokens: int | None = None
    max_tokens_cap: int | None = None
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    inflight: InflightConfig = field(default_factory=InflightConfig)
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    """vLLM's names of the model family's formats (``gateway.policy.parsers``)."""
    sampling: str = "engine"
    """A request's sampling when it names none: ``engine`` or ``keyed`` (``core.keyed``)."""
    keyed_workers: bool = True
    """Whether the workers draw keyed requests by their key: False for launched vLLM workers on a gateway
    without ``--sampling keyed`` (they do not load the keyed sampler), so a request's ``"sampling":
    "keyed"`` is refused there rather than silently drawn by vLLM's own sampler."""

    @classmethod
    def of(cls, config: GatewayConfig, launched: bool = True) -> TurnSettings:
        """`launched`: the gateway launches its pool's workers (False: a pool it was handed)."""
        launched_vllm = launched and not config.engine_urls and config.worker_kind != "fake"
        keyed_workers = config.sampling == "keyed" or not launched_vllm
        return cls(
            config.default_max_tokens, config.max_tokens_cap, config.failover, config.inflight,
            config.tool_call_parser, config.reasoning_parser, config.sampling, keyed_workers,
        )  # fmt: skip


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
    turn: TurnRecord | None = None
    """The turn, once `TurnRunner.run` has stored it (before its first event): a formatter that names
    the response after its turn (the Responses API's ids) reads it here."""


@dataclass(slots=True)
class Delta:
    """What one engine event added: visible text, finished tool calls, and the raw tokens."""

    content: str
    tool_calls: list[ToolCall]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    reasoning: str = ""  # text a reasoning parser split off (``reasoning_content``, thinking blocks)


@dataclass(slots=True)
class Done:
    """The turn's end: its record (stored, ``complete``), why it ended, and what a response reports."""

    turn: TurnRecord
    finish_reason: str
    content: str
    tool_calls: list[ToolCall]
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended the turn, if one did
    reasoning: str = ""
