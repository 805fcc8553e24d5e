"""Tool-call and reasoning parsers, one module per model family, chosen by vLLM's names
(``--tool-call-parser``, ``--reasoning-parser``) so a ``vllm serve`` command's flags carry over.

The gateway decodes the engine's tokens itself and runs the text through, per turn:
detokenizer → stop strings → reasoning parser → tool-call parser. Only the text presentation
changes: the turn's token ids are stored as generated. This package imports neither vLLM nor torch.

>>> p = make_tool_parser("qwen3_coder", tools=None)
>>> [e.name for e in p.feed("<tool_call>\\n<function=ls>\\n</function>\\n</tool_call>") + p.finish()]
['ls']
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal, get_args

from gateway.policy.parsers.base import (
    CallSink,
    ContentDelta,
    MalformedToolCall,
    ParseEvent,
    PassThrough,
    ReasoningDelta,
    ReasoningEvent,
    ReasoningParser,
    ToolCall,
    ToolParser,
)
from gateway.policy.parsers.hermes import TOOL_OPEN, HermesToolParser
from gateway.policy.parsers.llama3_json import Llama3JsonToolParser
from gateway.policy.parsers.mistral import MistralToolParser
from gateway.policy.parsers.qwen3_coder import Qwen3CoderToolParser
from gateway.policy.parsers.think import deepseek_r1, qwen3, think_text

ToolParserName = Literal["hermes", "qwen3_coder", "llama3_json", "mistral"]
ReasoningParserName = Literal["qwen3", "deepseek_r1"]
TOOL_PARSERS: tuple[str, ...] = get_args(ToolParserName)
SPECIAL_TAGS = frozenset({"mistral"})
"""Tool-call parsers whose tags are special tokens (``[TOOL_CALLS]``): their turns decode special tokens
as text (but EOS), as vLLM does for them, or the tags would vanish from the text."""
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)

__all__ = [
    "REASONING_PARSERS",
    "SPECIAL_TAGS",
    "TOOL_PARSERS",
    "CallSink",
    "ContentDelta",
    "MalformedToolCall",
    "ParseEvent",
    "PassThrough",
    "ReasoningDelta",
    "ReasoningEvent",
    "ReasoningParser",
    "ReasoningParserName",
    "ToolCall",
    "ToolParser",
    "ToolParserName",
    "forced_call_prefix",
    "make_reasoning_parser",
    "make_tool_parser",
    "think_text",
]


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None, enabled: bool = True) -> ToolParser:
    """A fresh parser for one turn (``tools``: the request's, whose schemas type qwen3_coder's
    arguments); a pass-through when the turn parses no tool calls."""
    if not enabled:
        return PassThrough()
    if name == "hermes":
        return HermesToolParser()
    if name == "qwen3_coder":
        return Qwen3CoderToolParser(tools)
    if name == "llama3_json":
        return Llama3JsonToolParser()
    if name == "mistral":
        return MistralToolParser()
    raise ValueError(f"unknown tool-call parser {name!r}; one of: {', '.join(TOOL_PARSERS)}")


def make_reasoning_parser(name: str | None) -> ReasoningParser | None:
    """A fresh reasoning parser for one turn, or None (reasoning stays in the content)."""
    if name is None:
        return None
    if name == "qwen3":
        return qwen3()
    if name == "deepseek_r1":
        return deepseek_r1()
    raise ValueError(f"unknown reasoning parser {name!r}; one of: {', '.join(REASONING_PARSERS)}")


_HERMES_ANY = TOOL_OPEN + '\n{"name": "'
_HERMES_NAMED = re.compile(re.escape(TOOL_OPEN) + r'\n\{"name": ("(?:[^"\\]|\\.)*"), "arguments": \Z')
_FORCED: dict[str, tuple[str, Callable[[str], str]]] = {  # family -> (any call, the call named NAME)
    "qwen3_coder": ("<tool_call>\n<function=", lambda name: f"<tool_call>\n<function={name}>\n"),
    "llama3_json": ('{"name": "', lambda name: '{"name": ' + json.dumps(name) + ', "parameters": '),
    "mistral": (
        '[TOOL_CALLS][{"name": "',
        lambda name: '[TOOL_CALLS][{"name": ' + json.dumps(name) + ', "arguments": ',
    ),
}


def forced_call_prefix(name: str, prefix: str) -> str:
    """The family's opening of a forced tool call, for the Hermes one that ``tool_choice_prefix``
    builds (the turn starts with it, so the model can only continue a call in its own format).

    >>> forced_call_prefix("qwen3_coder", '<tool_call>\\n{"name": "bash", "arguments": ')
    '<tool_call>\\n<function=bash>\\n'
    """
    if name not in _FORCED or not prefix:
        return prefix
    any_call, named = _FORCED[name]
    if prefix == _HERMES_ANY:
        return any_call
    match = _HERMES_NAMED.match(prefix)
    if match is None:
        return prefix  # already the family's
    return named(json.loads(match.group(1)))
