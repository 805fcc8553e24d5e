"""Qwen3-Coder XML tool calls (vLLM's ``--tool-call-parser qwen3_coder``)::

    <tool_call>
    <function=run>
    <parameter=cmd>
    ls -la
    </parameter>
    <parameter=timeout>
    30
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is typed by the tool's JSON schema as vLLM does
(``coerce_to_schema_type``): ``"30"`` is ``30`` for an integer parameter and stays ``"30"`` for a
string one; a parameter the schema does not name stays a string. One leading and one trailing
newline of a value are the template's markup and are dropped. A bare ``<function=…>…</function>``
(no ``<tool_call>`` around it) is accepted too, as vLLM does. A ``<tool_call>`` whose body is Hermes
JSON is parsed as Hermes (a forced ``tool_choice`` starts the turn with that form).

>>> tools = [{"type": "function", "function": {"name": "run", "parameters": {
...     "type": "object", "properties": {"n": {"type": "integer"}}}}}]
>>> p = Qwen3CoderToolParser(tools)
>>> [e.arguments for e in p.feed("<tool_call>\\n<function=run>\\n<parameter=n>\\n3\\n</parameter>\\n"
...                               "</function>\\n</tool_call>") + p.finish()]
['{"n": 3}']
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.policy.parsers.base import CallSink, ParseEvent, ToolCall, partial_suffix
from gateway.policy.parsers.hermes import _parse_call as parse_hermes_call

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"

_FUNC = re.compile(r"<function=([^>]*)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM = re.compile(
    r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)",
    re.DOTALL,
)

_ALIASES = {
    "str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
    "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
    "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
    "float": "number", "float32": "number", "float64": "number", "double": "number",
    "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array",
}  # fmt: skip
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array", "string")


def schema_types(schema: Any) -> set[str]:
    """The JSON-schema types a parameter may take (``type``, ``enum`` values, ``anyOf``/``oneOf``/
    ``allOf``); ``{"string"}`` when the schema says nothing."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    for t in [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []:
        if isinstance(t, str):
            types.add(_ALIASES.get(t.strip().lower(), t.strip().lower()))
    enum = schema.get("enum")
    for v in enum if isinstance(enum, list) else []:
        types.add(
            "null" if v is None else "boolean" if isinstance(v, bool) else "integer" if isinstance(v, int)
            else "number" if isinstance(v, float) else "string" if isinstance(v, str)
            else "array" if isinstance(v, list) else "object"
        )  # fmt: skip
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else []:
            types |= schema_types(choice)
    return types or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def _json(value: str) -> tuple[bool, Any]:
    try:
        parsed = json.loads(value)
    except ValueError:
        return False, None
    return _finite(parsed), parsed


def coerce(value: str, types: set[str]) -> Any:
    """A parameter's text as the first of its schema types it reads as (null, integer, number,
    boolean, object, array, string), else as JSON, else the text itself."""
    for kind in _PRIORITY:
        if kind not in types:
            continue
        if kind == "string":
            return value
        if kind == "null" and value.lower() == "null":
            return None
        if kind == "integer":
            try:
                return int(value)
            except ValueError:
                continue
        if kind == "number":
            try:
                num = float(value)
            except ValueError:
                continue
            if math.isfinite(num):
                return int(num) if num == int(num) else num
        if kind == "boolean" and value.lower().strip() in ("true", "1", "false", "0"):
            return value.lower().strip() in ("true", "1")
        if kind in ("object", "array"):
            ok, parsed = _json(value)
            if ok:
                return parsed
    ok, parsed = _json(value)
    return parsed if ok else value


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


def _trim(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def parse_functions(body: str, tools: list[dict[str, Any]] | None) -> list[tuple[str, str]] | str:
    """(name, arguments JSON) of each ``<function=…>`` in a call's body, else why it is not a call."""
    calls: list[tuple[str, str]] = []
    rest = body
    for match in _FUNC.finditer(body):
        name = match.group(1).strip()
        if not name:
            return "a <function=…> with no name"
        props = _properties(tools, name)
        args: dict[str, Any] = {}
        for param in _PARAM.finditer(match.group(2)):
            key = param.group(1).strip()
            value = _trim(param.group(2))
            args[key] = coerce(value, schema_types(props[key])) if key in props else value
        calls.append((name, json.dumps(args, ensure_ascii=False)))
        rest = rest.replace(match.group(0), "", 1)
    if not calls:
        return "no <function=NAME> in the tool call"
    if rest.strip():
        return f"text outside <function=…> in a tool call: {rest.strip()[:80]!r}"
    return calls


@dataclass(slots=True)
class Qwen3CoderToolParser:
    """Qwen3-Coder's XML calls, parsed as each ``</tool_call>`` (or bare ``</function>``) arrives."""

    tools: list[dict[str, Any]] | None = None
    out: CallSink = field(default_factory=CallSink)
    _buf: str = ""
    _close: str | None = None  # inside a call: the tag that ends it; its opening tag is in _opened
    _opened: str = ""

    @property
    def calls(self) -> list[ToolCall]:
        return self.out.calls

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if self._close is not None:
                end = self._buf.find(self._close)
                if end < 0:
                    return events
                self._call(self._buf[:end], self._close, events)
                self._buf = self._buf[end + len(self._close) :]
                self._close = None
                continue
            hits = [(at, tag) for tag in (TOOL_OPEN, FUNC_OPEN) if (at := self._buf.find(tag)) >= 0]
            if hits:
                at, tag = min(hits)
                self.out.content(self._buf[:at], events)
                if tag == TOOL_OPEN:
                    self._buf, self._opened, self._close = self._buf[at + len(tag) :], tag, TOOL_CLOSE
                else:  # a bare function: its own tag is part of the body
                    self._buf, self._opened, self._close = self._buf[at:], "", FUNC_CLOSE
                continue
            keep = max(partial_suffix(self._buf, TOOL_OPEN), partial_suffix(self._buf, FUNC_OPEN))
            self.out.content(self._buf[: len(self._buf) - keep], events)
            self._buf = self._buf[len(self._buf) - keep :]
            return events

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._close is not None:  # unterminated: accepted if what came parses (as vLLM does)
            self._call(self._buf, "", events)
        else:
            self.out.content(self._buf, events)
        self._buf, self._close = "", None
        return events

    def _call(self, body: str, close: str, events: list[ParseEvent]) -> None:
        bare = self._opened != TOOL_OPEN
        raw = self._opened + body + close
        parsed: list[tuple[str, str]] | str
        if not bare and FUNC_OPEN not in body and body.lstrip().startswith("{"):
            hermes = parse_hermes_call(body.strip())
            parsed = [hermes] if isinstance(hermes, tuple) else hermes
        else:
            parsed = parse_functions(body + close if bare else body, self.tools)
        if isinstance(parsed, str):
            self.out.malformed(raw, parsed, events)
            return
        for name, arguments in parsed:
            self.out.call(name, arguments, events)
