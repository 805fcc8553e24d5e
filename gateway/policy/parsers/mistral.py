"""Mistral tool calls (vLLM's ``--tool-call-parser mistral``): ``[TOOL_CALLS]`` followed by a JSON
list of ``{"name": …, "arguments": …}`` objects (a single object is accepted too), or the newer
tokenizers' ``[TOOL_CALLS]name[ARGS]{…}``. Text before the tag is content. Call ids are 9
alphanumeric characters, the form Mistral's chat templates require of the ids sent back.

>>> p = MistralToolParser()
>>> [(c.name, c.arguments) for c in p.feed('[TOOL_CALLS][{"name": "ls", "arguments": {"d": "."}}]')
...  + p.finish()]
[('ls', '{"d": "."}')]
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from gateway.policy.parsers.base import CallSink, ParseEvent, ToolCall, partial_suffix
from gateway.policy.parsers.llama3_json import call_of

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits


def mistral_id() -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


def _decoded(head: str) -> tuple[list[tuple[str, str]], int] | str | None:
    """The calls at the head of the text after ``[TOOL_CALLS]`` and where they end; why they are
    not calls; or None when they may still be arriving."""
    if head.startswith(("[", "{")):
        try:
            obj, end = _DECODER.raw_decode(head)
        except ValueError as e:
            return f"invalid JSON after [TOOL_CALLS]: {e}"  # None is decided by the caller
        items: list[Any] = obj if isinstance(obj, list) else [obj]
        calls = [call_of(item) for item in items]
        bad = next((c for c in calls if isinstance(c, str)), None)
        if bad is not None or not calls:
            return bad or "an empty list of tool calls"
        return [c for c in calls if not isinstance(c, str)], end
    at = head.find(ARGS)
    if at < 0:
        return None
    name, rest = head[:at].strip(), head[at + len(ARGS) :].lstrip()
    try:
        args, end = _DECODER.raw_decode(rest)
    except ValueError as e:
        return f"invalid JSON after [ARGS]: {e}"
    if not name or not isinstance(args, dict):
        return "[TOOL_CALLS]NAME[ARGS] needs a name and a JSON object"
    return [(name, json.dumps(args, ensure_ascii=False))], len(head) - len(rest) + end


@dataclass(slots=True)
class MistralToolParser:
    """Mistral's ``[TOOL_CALLS]`` calls, sent when their JSON closes."""

    out: CallSink = field(default_factory=CallSink)
    _buf: str = ""
    _in_calls: bool = False
    _closing: bool = False  # the latest text holds a "]" or "}": the calls may have completed

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        self._closing = "]" in text or "}" in text
        events: list[ParseEvent] = []
        while True:
            if self._in_calls:
                if not self._calls(events, final=False):
                    return events
                continue
            at = self._buf.find(TOOL_CALLS)
            if at >= 0:
                self.out.content(self._buf[:at], events)
                self._buf, self._in_calls = self._buf[at + len(TOOL_CALLS) :], True
                continue
            keep = partial_suffix(self._buf, TOOL_CALLS)
            self.out.content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._in_calls:
            self._calls(events, final=True)
        if not self._in_calls:
            self.out.content(self._buf, events)
        self._buf, self._in_calls = "", False
        return events

    def _calls(self, events: list[ParseEvent], final: bool) -> bool:
        """Parse the calls after ``[TOOL_CALLS]``: True when they were sent (or found malformed) and
        the text after them is content again; False while they may still be arriving."""
        head = self._buf.lstrip()
        if not final and (not head or not self._closing):
            return False
        result = _decoded(head)
        if (result is None or isinstance(result, str)) and not final:
            return False  # still arriving, or malformed: the end of the reply tells
        if result is None or isinstance(result, str):
            self.out.malformed(TOOL_CALLS + self._buf, result or "no tool call after [TOOL_CALLS]", events)
            self._buf, self._in_calls = "", False
            return True
        for name, arguments in result[0]:
            self.out.call(name, arguments, events, mistral_id())
        self._buf, self._in_calls = head[result[1] :], False
        return True
