"""Streaming output: stop strings, and the tool-call parsers' names (the parsers themselves, one module
per model family, are in ``gateway.policy.parsers``; the Hermes names stay importable from here).

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

from core.errors import InvalidRequest
from gateway.policy.parsers.base import ContentDelta, MalformedToolCall, ParseEvent, ToolCall
from gateway.policy.parsers.base import partial_suffix as _partial_suffix
from gateway.policy.parsers.hermes import TOOL_CLOSE, TOOL_OPEN, HermesToolParser

__all__ = [
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "ContentDelta",
    "HermesToolParser",
    "MalformedToolCall",
    "ParseEvent",
    "StopTrimmer",
    "ToolCall",
    "tool_choice_prefix",
]


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
