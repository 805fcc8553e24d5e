"""Streaming output parsers: stop strings and Hermes/Qwen ``<tool_call>{json}</tool_call>`` tool calls.

Streamed and non-streamed responses run through the same code, so both give the same content and
tool calls by construction: a non-streamed response is the join of the deltas a stream would send.

>>> parser = HermesToolParser()
>>> events = parser.feed('Let me look.<tool_call>\\n{"name": "ls", "arguments": {}}\\n</tool_call>')
>>> events += parser.finish()
>>> events  # doctest: +ELLIPSIS
[ContentDelta(text='Let me look.'), ToolCall(index=0, id='call_...', name='ls', arguments='{}')]
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from core.errors import InvalidRequest

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass(frozen=True, slots=True)
class MalformedToolCall:
    """A ``<tool_call>`` block whose JSON did not parse; its raw text went out as content."""

    raw: str
    reason: str


ParseEvent = ContentDelta | ToolCall | MalformedToolCall


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StopTrimmer:
    """Cuts the text at the first stop string (excluded), holding back what may start one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that cut the text (Anthropic reports it)

    def feed(self, text: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        hits = [(at, s) for s in self.stops if (at := buf.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at]
        keep = max(_partial_suffix(buf, s) for s in self.stops)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out


def tool_choice_prefix(names: list[str], choice: str | None, name: str | None = None) -> tuple[str, bool]:
    """(forced assistant prefix, whether to parse tool calls) for a tool choice in OpenAI's terms:
    ``"auto"`` (or None), ``"none"``, ``"required"``, or a tool ``name`` to force. A call is forced by
    starting the assistant turn with the opening of a Hermes call, which the model can only continue.
    Both protocols use it (Anthropic's ``any`` is ``"required"``, its ``tool`` is a name).

    >>> tool_choice_prefix(["bash"], None, "bash")
    ('<tool_call>\\n{"name": "bash", "arguments": ', True)
    >>> tool_choice_prefix(["bash"], "none")
    ('', False)
    """
    if name is None and choice in (None, "auto"):
        return "", bool(names)
    if name is None and choice == "none":
        return "", False
    if not names:
        raise InvalidRequest(
            "tool_choice requires 'tools'; send the tools or drop tool_choice", "tool_choice"
        )
    if name is None:
        return TOOL_OPEN + '\n{"name": "', True
    if name not in names:
        raise InvalidRequest(
            f"tool_choice names '{name}', which is not in 'tools' ({', '.join(names)})", "tool_choice"
        )
    return TOOL_OPEN + '\n{"name": ' + json.dumps(name) + ', "arguments": ', True


def _parse_call(raw: str) -> tuple[str, str] | str:
    """(name, arguments JSON) for a valid call body, else the reason it is not one."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return f"invalid JSON in tool call: {e}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'tool call must be an object with a string "name"'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(slots=True)
class HermesToolParser:
    """Splits generated text into content and tool calls, incrementally."""

    enabled: bool = True
    calls: list[ToolCall] = field(default_factory=list)
    _buf: str = ""
    _in_call: bool = False
    _ws: str = ""  # whitespace after a tool call, held until real content follows

    def feed(self, text: str) -> list[ParseEvent]:
        if not self.enabled:
            return [ContentDelta(text)] if text else []
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if self._in_call:
                end = self._buf.find(TOOL_CLOSE)
                if end < 0:
                    return events
                self._close_call(self._buf[:end], TOOL_CLOSE, events)
                self._buf = self._buf[end + len(TOOL_CLOSE) :]
                self._in_call = False
                continue
            start = self._buf.find(TOOL_OPEN)
            if start >= 0:
                self._content(self._buf[:start], events)
                self._buf = self._buf[start + len(TOOL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, TOOL_OPEN)
            self._content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._in_call:
            # An unterminated call (e.g. the model stopped right after the JSON): accept it if it parses.
            self._close_call(self._buf, "", events)
        else:
            self._content(self._buf, events)
        self._buf = ""
        self._in_call = False
        return events

    def _content(self, text: str, events: list[ParseEvent]) -> None:
        if not text:
            return
        if self.calls and not (self._ws + text).strip():
            self._ws += text
            return
        events.append(ContentDelta(self._ws + text))
        self._ws = ""

    def _close_call(self, body: str, close: str, events: list[ParseEvent]) -> None:
        parsed = _parse_call(body.strip())
        if isinstance(parsed, str):
            raw = TOOL_OPEN + body + close
            self._content(raw, events)
            events.append(MalformedToolCall(raw, parsed))
            return
        call = ToolCall(len(self.calls), f"call_{secrets.token_hex(12)}", parsed[0], parsed[1])
        self.calls.append(call)
        events.append(call)
