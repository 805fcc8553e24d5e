"""Llama 3.x JSON tool calls (vLLM's ``--tool-call-parser llama3_json``): an optional
``<|python_tag|>``, then one or more ``{"name": …, "parameters": …}`` objects (``"arguments"`` is
accepted too) separated by ``;``.

A reply is a call when it starts (after whitespace) with ``{`` or ``<|python_tag|>``, or when
``<|python_tag|>`` follows some text; otherwise it is content, streamed as it comes. Each call is
sent as soon as its object is complete. What does not read as calls (``{`` starting prose, an
object without a ``"name"``, text after the calls) comes back as content with a ``MalformedToolCall``.

>>> p = Llama3JsonToolParser()
>>> [c.name for c in p.feed('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
...  + p.finish()]
['a', 'b']
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gateway.policy.parsers.base import CallSink, ParseEvent, ToolCall, partial_suffix

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def call_of(obj: Any) -> tuple[str, str] | str:
    """(name, arguments JSON) of a decoded call object, else why it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'a tool call must be an object with a string "name"'
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(slots=True)
class Llama3JsonToolParser:
    """Llama 3 JSON calls, each sent when its object closes."""

    out: CallSink = field(default_factory=CallSink)
    _buf: str = ""
    _mode: str = "start"  # start (nothing decided yet), text, calls
    _raw: str = ""  # the calls' text so far (returned as content if they turn out malformed)
    _closing: bool = False  # the latest text holds a "}": an object may have completed

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        self._closing = "}" in text
        events: list[ParseEvent] = []
        self._run(events, final=False)
        return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        self._run(events, final=True)
        self._buf = ""
        return events

    def _run(self, events: list[ParseEvent], final: bool) -> None:
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                if PYTHON_TAG.startswith(head) and len(head) < len(PYTHON_TAG) and not final:
                    return  # "", "<|pyth"…: may still be a call
                self._mode = "calls" if head.startswith((PYTHON_TAG, "{")) else "text"
            if self._mode == "text":
                at = self._buf.find(PYTHON_TAG)
                if at < 0:
                    keep = 0 if final else partial_suffix(self._buf, PYTHON_TAG)
                    self.out.content(self._buf[: len(self._buf) - keep], events)
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self.out.content(self._buf[:at], events)
                self._buf, self._mode = self._buf[at:], "calls"
            if not self._decode(events, final):
                return

    def _decode(self, events: list[ParseEvent], final: bool) -> bool:
        """Send every complete call object at the head of the buffer. True when what follows is
        text again (to scan for another ``<|python_tag|>``); False when the buffer waits for more."""
        while True:
            head = self._buf.lstrip()
            while head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG) :].lstrip()
            if self.calls and head.startswith(";"):
                head = head[1:].lstrip()
            self._raw += self._buf[: len(self._buf) - len(head)]
            self._buf = head
            if not head and final and self._raw.strip(" \t\r\n;"):
                self._malformed(self._raw, "no tool call after <|python_tag|>", events)  # the tag alone
                return False
            if not head or (not final and PYTHON_TAG.startswith(head)):
                return False  # more to come
            if not head.startswith("{"):  # text: after a tag it is malformed, after calls it is content
                if PYTHON_TAG in self._raw:
                    self._malformed(self._raw, "text after <|python_tag|> that is not a call object", events)
                else:
                    self.out.content(self._raw, events)
                self._raw, self._mode = "", "text"
                return True
            if not final and not self._closing:
                return False  # no object can have completed: no need to decode again (long calls)
            try:
                obj, end = _DECODER.raw_decode(head)
            except ValueError as e:
                if final:  # prose that starts with "{", or a cut object
                    self._malformed(self._raw + head, f"invalid JSON in tool call: {e}", events)
                    self._buf = ""
                return False  # not final: an object still arriving (or prose: the end will tell)
            parsed = call_of(obj)
            if isinstance(parsed, str):
                self._malformed(self._raw + head[:end], parsed, events)
                self._buf, self._raw, self._mode = head[end:], "", "text"
                return True
            self.out.call(parsed[0], parsed[1], events)
            self._buf, self._raw = head[end:], ""

    def _malformed(self, raw: str, reason: str, events: list[ParseEvent]) -> None:
        self._raw = ""
        self.out.malformed(raw, reason, events)
