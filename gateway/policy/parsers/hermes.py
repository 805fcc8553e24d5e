"""Hermes / Qwen2.5 / Qwen3 JSON tool calls: ``<tool_call>{"name": …, "arguments": …}</tool_call>``
(vLLM's ``--tool-call-parser hermes``).

>>> parser = HermesToolParser()
>>> events = parser.feed('Let me look.<tool_call>\\n{"name": "ls", "arguments": {}}\\n</tool_call>')
>>> events += parser.finish()
>>> events  # doctest: +ELLIPSIS
[ContentDelta(text='Let me look.'), ToolCall(index=0, id='call_...', name='ls', arguments='{}')]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gateway.policy.parsers.base import CallSink, ContentDelta, ParseEvent, ToolCall
from gateway.policy.parsers.base import partial_suffix as _partial_suffix

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


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
    out: CallSink = field(default_factory=CallSink)
    _buf: str = ""
    _in_call: bool = False

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

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
                self.out.content(self._buf[:start], events)
                self._buf = self._buf[start + len(TOOL_OPEN) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, TOOL_OPEN)
            self.out.content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._in_call:
            # An unterminated call (e.g. the model stopped right after the JSON): accept it if it parses.
            self._close_call(self._buf, "", events)
        else:
            self.out.content(self._buf, events)
        self._buf = ""
        self._in_call = False
        return events

    def _close_call(self, body: str, close: str, events: list[ParseEvent]) -> None:
        parsed = _parse_call(body.strip())
        if isinstance(parsed, str):
            self.out.malformed(TOOL_OPEN + body + close, parsed, events)
            return
        self.out.call(parsed[0], parsed[1], events)
