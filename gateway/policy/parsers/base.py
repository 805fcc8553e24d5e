"""The parser seams: events, the ``ToolParser`` and ``ReasoningParser`` protocols, and shared helpers.

Every parser is fed decoded text as it arrives (any chunking, down to one character) and returns
events; ``finish()`` flushes what it held back. No parser raises on model output: a reply that is
neither text nor a valid call comes back as content (with a ``MalformedToolCall`` for the log), and
a possible tag prefix at a chunk's end is held back until the next chunk shows what it is.

>>> from gateway.policy.parsers import make_tool_parser
>>> p = make_tool_parser("llama3_json", tools=None)
>>> p.feed('{"name": "ls", "parameters": {}}') + p.finish()  # doctest: +ELLIPSIS
[ToolCall(index=0, id='call_...', name='ls', arguments='{}')]
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Text of the model's reasoning (inside ``<think>…</think>``), shown apart from the content."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class MalformedToolCall:
    """A tool-call block that did not parse; its raw text went out as content."""

    raw: str
    reason: str


ParseEvent = ContentDelta | ToolCall | MalformedToolCall
ReasoningEvent = ContentDelta | ReasoningDelta


class ToolParser(Protocol):
    """Splits generated text into content and tool calls, incrementally."""

    @property
    def calls(self) -> list[ToolCall]: ...

    def feed(self, text: str) -> list[ParseEvent]: ...

    def finish(self) -> list[ParseEvent]: ...


class ReasoningParser(Protocol):
    """Splits generated text into reasoning and the rest (content, which goes on to the tool parser)."""

    def feed(self, text: str) -> list[ReasoningEvent]: ...

    def finish(self) -> list[ReasoningEvent]: ...


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class CallSink:
    """Where a parser's results go: content (whitespace after a call held until real text follows,
    as the Hermes parser does), numbered calls, and malformed blocks returned as content."""

    calls: list[ToolCall] = field(default_factory=list)
    _ws: str = ""

    def content(self, text: str, events: list[ParseEvent]) -> None:
        if not text:
            return
        if self.calls:  # whitespace after a call is held until text follows (dropped at the end)
            body = text.rstrip()
            if not body:
                self._ws += text
                return
            text, self._ws = self._ws + body, text[len(body) :]
            events.append(ContentDelta(text))
            return
        events.append(ContentDelta(self._ws + text))
        self._ws = ""

    def call(self, name: str, arguments: str, events: list[ParseEvent], id_: str | None = None) -> None:
        call = ToolCall(len(self.calls), id_ or call_id(), name, arguments)
        self.calls.append(call)
        events.append(call)

    def malformed(self, raw: str, reason: str, events: list[ParseEvent]) -> None:
        self.content(raw, events)
        events.append(MalformedToolCall(raw, reason))


@dataclass(slots=True)
class PassThrough:
    """The parser when tool calls are not parsed (no tools, ``tool_choice: none``): all text is content."""

    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> list[ParseEvent]:
        return [ContentDelta(text)] if text else []

    def finish(self) -> list[ParseEvent]:
        return []
