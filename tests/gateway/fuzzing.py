"""Strategies and checks for the gateway fuzzer (``tests/gateway/test_fuzz.py``).

A drawn `Plan` is a valid request for one route, the `Mutation`s to apply to its body, how the body
goes out as bytes (`Encoding`) and with which headers. A plan is resolved against the running
gateway only when it is sent (which sessions exist, what the last answer in a session was), so a
mutation names its target with a selector: ``at`` picks a node of whatever body it meets.

Values ``json.dumps`` cannot write (``NaN``, ``1e400``, ten thousand nested arrays) travel as `Raw`
tokens; lone surrogates go out as ``\\ud800`` escapes, or as the invalid UTF-8 bytes of a surrogate.

``check_answer`` is what every answer must pass: no 5xx, a JSON error in the route's protocol shape
(OpenAI's ``{"error": {message, type, param, code}}``; Anthropic's ``{"type": "error", "error":
{type, message}}`` under ``/v1/messages…``), and SSE streams whose error events have that shape too
(a Responses stream's: ``{type: "error", code, message, param, sequence_number}``, its events numbered
in order).

>>> encode_json({"a": Raw("NaN"), "b": ["\\ud800"]})
'{"a": NaN, "b": ["\\\\ud800"]}'
>>> apply({"a": [1, 2]}, [Mutation("delete", at=3)])
{'a': [1]}
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import os
import pathlib
import re
import string
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import quote, unquote

import httpx
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

Json = Any
ANTHROPIC_PATH = re.compile(r"/v1/messages(/|$)")  # the routes that answer errors in Anthropic's shape
RESPONSES_PATH = re.compile(r"/v1/responses$")  # the routes that stream Responses events


# --- JSON that json.dumps cannot write ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Raw:
    """A JSON token written as it is."""

    text: str

    def __repr__(self) -> str:
        return f"Raw({self.text[:40]!r}{'…' if len(self.text) > 40 else ''}, len={len(self.text)})"


def encode_json(value: Json, ensure_ascii: bool = True) -> str:
    """``value`` as JSON text, `Raw` tokens verbatim (iterative: a mutated body may nest deeply)."""
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Text | Raw):
            out.append(item.text)
        elif isinstance(item, dict):
            parts: list[Any] = [_Text("{")]
            for i, (k, v) in enumerate(item.items()):
                key = k if isinstance(k, str) else str(k)
                parts += [_Text((", " if i else "") + json.dumps(key, ensure_ascii=ensure_ascii) + ": "), v]
            stack.extend(reversed([*parts, _Text("}")]))
        elif isinstance(item, list):
            parts = [_Text("[")]
            for i, v in enumerate(item):
                parts += [_Text(", ")] if i else []
                parts.append(v)
            stack.extend(reversed([*parts, _Text("]")]))
        else:
            out.append(json.dumps(item, ensure_ascii=ensure_ascii))
    return "".join(out)


@dataclass(frozen=True, slots=True)
class _Text:
    text: str


# --- mutations ---------------------------------------------------------------------------------------

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class Mutation:
    """One change to a body: ``at`` selects the node (``paths(body)[at % n]``, the root is 0)."""

    kind: Literal["replace", "same", "delete", "add", "wrap"]
    """``same``: another value of the node's JSON type (`similar`), valid more often than not."""
    at: int = 0
    value: Json = None
    key: str = ""
    pick: int = 0


def paths(tree: Json) -> list[Path]:
    """Every node's path, root first, in document order."""
    out: list[Path] = []
    stack: list[tuple[Path, Json]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        out.append(path)
        if len(path) > 12:  # a Raw or a drawn value nests no deeper; bodies never do
            continue
        children = (
            list(node.items())
            if isinstance(node, dict)
            else list(enumerate(node))
            if isinstance(node, list)
            else []
        )
        stack.extend(((*path, k), v) for k, v in reversed(children))
    return out


def _get(tree: Json, path: Path) -> Json:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: Json, path: Path, value: Json) -> Json:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def apply(body: Json, mutations: list[Mutation] | tuple[Mutation, ...]) -> Json:
    """``body`` with each mutation applied in turn (a copy)."""
    tree = copy.deepcopy(body)
    for m in mutations:
        nodes = paths(tree)
        path = nodes[m.at % len(nodes)]
        node = _get(tree, path)
        if m.kind == "replace":
            tree = _set(tree, path, copy.deepcopy(m.value))
        elif m.kind == "same":
            tree = _set(tree, path, similar(node, m.pick))
        elif m.kind == "delete":
            if not path:
                tree = {}
            else:
                parent = _get(tree, path[:-1])
                del parent[path[-1]]
        elif m.kind == "add":
            if isinstance(node, dict):
                node[m.key] = copy.deepcopy(m.value)
            elif isinstance(node, list):
                node.append(copy.deepcopy(m.value))
            else:
                tree = _set(tree, path, {m.key: node})
        else:  # wrap
            tree = _set(tree, path, [node] if m.at % 2 else {m.key or "value": node})
    return tree


# --- nasty values ------------------------------------------------------------------------------------


def _nested(depth: int, kind: str) -> Raw:
    if kind == "array":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a": ' * depth + "1" + "}" * depth)


NASTY_TOKENS = [
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("1E999"),
    Raw("-0"), Raw("0e99999"), Raw("123456789012345678901234567890"), Raw("1" + "0" * 5000),
    Raw("-" + "9" * 4301), Raw("1.5e-400"),
]  # fmt: skip
NASTY_STRINGS = [
    "", " ", "\ud800", "\udfff", "x\udbffy", "\ud83d", "\u0000", "\ufeff", "\u202e", "🦀" * 50,
    "é" * 200, "<tool_call>", "</tool_call>", '<tool_call>\n{"name": "f"', "<|im_end|>",
    "<|im_start|>assistant\n", "{{ 7*7 }}", "{% raw %}", "\n" * 500, "word " * 4000, "a" * 70000,
    "null", "NaN", "policy", "-1", "\\ud800",
]  # fmt: skip
NASTY_NUMBERS = [
    0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 10**30, -(10**30), 0.5, -0.0, 1e308, -1e308, 5e-324,
    4096, 4095, 65536, 1_000_000,
]  # fmt: skip
NESTING = [_nested(d, k) for d in (63, 64, 65, 200, 100_000) for k in ("array", "object")]

# Field names of every protocol: an "extra" field is often one that means something somewhere.
FIELD_NAMES = [
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream", "stream_options",
    "tools", "tool_choice", "temperature", "top_p", "top_k", "stop", "stop_sequences", "seed", "n",
    "logprobs", "top_logprobs", "echo", "system", "metadata", "reward", "info", "override", "url",
    "sandbox", "role", "content", "type", "text", "name", "input", "id", "tool_calls", "tool_call_id",
    "tool_use_id", "thinking", "functions", "function_call", "response_format", "logit_bias", "suffix",
    "best_of", "mcp_servers", "container", "output_format", "include_usage", "is_error", "signature",
    "parallel_tool_calls", "user", "__proto__", "", "\ud800", "é", "instructions", "previous_response_id",
    "max_output_tokens", "include", "store", "call_id", "arguments", "output", "summary", "background",
    "reasoning_content", "reasoning", "group", "__belayer_group", "sampling", "__belayer_seed",
]  # fmt: skip

samplings = st.sampled_from(["keyed", "engine", "keyed", "Keyed", "", 1])
"""A request's sampling (core.keyed): mostly valid, now and then not."""

# Strings that mean something somewhere: a role, a block or tool-choice type, a tool name.
WORDS = [
    "user", "assistant", "system", "developer", "tool", "function", "text", "image", "tool_use",
    "tool_result", "thinking", "redacted_thinking", "auto", "any", "none", "required", "get_weather",
    "call_0", "toolu_0", "object", "string", "policy", "claude-haiku-4-5", "message", "function_call",
    "function_call_output", "reasoning", "reasoning_text", "input_text", "output_text", "input_image",
    "item_reference", "web_search", "allowed_tools", "message.output_text.logprobs", "resp_0",
]  # fmt: skip


def similar(node: Json, pick: int) -> Json:
    """Another value of `node`'s JSON type, chosen by `pick`: a meaningful word or a nasty string for
    a string, an edge for a number, the other bool, a list emptied, doubled, reversed or cut to one
    item, an object emptied or without one of its keys."""
    if isinstance(node, bool):
        return not node
    if isinstance(node, int):
        return [0, -1, 1, 2**31, 2**63, 10**30, node + 1, node - 1, node * 1000][pick % 9]
    if isinstance(node, float):
        return [0.0, -0.0, 1.0, -1.0, 2.0000001, 1e-7, 5e-324, 1e308, node * 2][pick % 9]
    if isinstance(node, str):
        pool = [*WORDS, *NASTY_STRINGS, node * 2, node.upper(), node[:1], node + "\u0000"]
        return pool[pick % len(pool)]
    if isinstance(node, list):
        return [[], node * 2, node[::-1], node[:1], [*node, *node[:1]]][pick % 5]
    if isinstance(node, dict) and node:
        if pick % 3 == 0:
            return {}
        drop = list(node)[pick % len(node)]
        return {k: v for k, v in node.items() if k != drop}
    return node


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
any_json = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
nasty = st.one_of(
    st.sampled_from(NASTY_TOKENS),
    st.sampled_from(NASTY_STRINGS),
    st.sampled_from(NASTY_NUMBERS),
    st.sampled_from(NESTING),
    any_json,
    st.text(
        st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    ),  # lone surrogates too
)
keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=8)
mutation = st.builds(
    Mutation,
    kind=st.sampled_from(["same", "replace", "delete", "add", "wrap", "same"]),
    at=st.integers(0, 200),
    value=nasty,
    key=keys,
    pick=st.integers(0, 1000),
)
# A third of the bodies go out valid: the answers to those, and the sessions they build, are what the
# mutated ones meet.
mutations = st.sampled_from([0, 0, 1, 1, 2, 3]).flatmap(lambda n: st.lists(mutation, min_size=n, max_size=n))


# --- valid bodies ------------------------------------------------------------------------------------

words = st.text(string.ascii_letters + " .,!?", min_size=1, max_size=24)
texts = words | st.text(max_size=24)  # unicode (no surrogates: st.text leaves them out unless asked)
models = st.sampled_from(["policy"] * 6 + ["claude-sonnet-4-5", "claude-haiku-4-5", "judge-1", "gpt-4o"])
"""The policy, an alias of it, an auxiliary model the policy answers, a refused one, an unknown one
(with the gateway's ``AUX_CONFIG``)."""
AUX_CONFIG: dict[str, Any] = {
    "model_aliases": {"claude-*": "policy"},
    "auxiliary_models": {"claude-haiku-*": "policy", "judge-*": "reject"},
}
tool_names = st.sampled_from(["get_weather", "lookup", "run", "f"])
arguments = st.dictionaries(st.sampled_from(["city", "q", "n", "flag"]), scalars, max_size=3)
schemas: st.SearchStrategy[dict[str, Any]] = st.sampled_from(
    [{"type": "object", "properties": {"city": {"type": "string"}}}, {}]
)


@st.composite
def openai_tool_calls(draw: st.DrawFn) -> list[dict[str, Any]]:
    n = draw(st.integers(1, 2))
    return [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": draw(tool_names), "arguments": json.dumps(draw(arguments))},
        }
        for i in range(n)
    ]


@st.composite
def openai_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(texts)})
    for _ in range(draw(st.integers(0, 2))):
        out.append({"role": "user", "content": draw(texts)})
        if draw(st.booleans()):
            calls = draw(openai_tool_calls())
            reply = {"role": "assistant", "content": draw(st.none() | texts), "tool_calls": calls}
            if draw(st.booleans()):  # reasoning sent back (rendered as <think>…</think>)
                reply[draw(st.sampled_from(["reasoning_content", "reasoning"]))] = draw(st.none() | texts)
            out.append(reply)
            out += [{"role": "tool", "tool_call_id": c["id"], "content": draw(texts)} for c in calls]
        else:
            out.append({"role": "assistant", "content": draw(texts)})
    parts = st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=2)
    out.append({"role": "user", "content": draw(texts | parts)})
    return out


def _openai_tools(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(tool_names, min_size=1, max_size=3, unique=True))
    return [
        {"type": "function", "function": {"name": n, "description": draw(texts), "parameters": draw(schemas)}}
        for n in names
    ]


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(models), "messages": draw(openai_messages())}
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(1, 48))
    if draw(st.booleans()):
        tools = _openai_tools(draw)
        body["tools"] = tools
        choice = st.sampled_from(["auto", "none", "required"]) | st.just(
            {"type": "function", "function": {"name": tools[0]["function"]["name"]}}
        )
        if draw(st.booleans()):
            body["tool_choice"] = draw(choice)
    optional = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(-1, 50),
        "stop": texts | st.lists(words, max_size=2),
        "seed": st.integers(0, 2**31),
        "presence_penalty": st.floats(-2, 2),
        "sampling": samplings,
        "user": texts,
        "parallel_tool_calls": st.booleans(),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        body[name] = draw(optional[name])
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return body


@st.composite
def completion_bodies(draw: st.DrawFn) -> dict[str, Any]:
    ids = st.lists(st.integers(0, 8000), min_size=1, max_size=12)
    prompt = draw(
        texts | ids | st.lists(words, min_size=1, max_size=1) | st.lists(ids, min_size=1, max_size=1)
    )
    body: dict[str, Any] = {"model": draw(models), "prompt": prompt, "max_tokens": draw(st.integers(1, 32))}
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["echo"] = draw(st.booleans())
    if draw(st.booleans()):
        body["stop"] = draw(words)
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    return body


@st.composite
def anthropic_messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text_block = st.fixed_dictionaries({"type": st.just("text"), "text": texts})
    for i in range(draw(st.integers(0, 2))):
        out.append({"role": "user", "content": draw(texts | st.lists(text_block, min_size=1, max_size=2))})
        blocks: list[dict[str, Any]] = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(texts), "signature": "sig"})
        blocks.append({"type": "text", "text": draw(texts)})
        uses = []
        if draw(st.booleans()):
            uses = [
                {"type": "tool_use", "id": f"toolu_{i}", "name": draw(tool_names), "input": draw(arguments)}
            ]
        out.append({"role": "assistant", "content": blocks + uses})
        if uses:
            result = texts | st.lists(text_block, max_size=2)
            out.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": u["id"], "content": draw(result)} for u in uses
                    ],
                }
            )
    last = {"role": "user", "content": draw(texts | st.lists(text_block, min_size=1, max_size=2))}
    if out and out[-1]["role"] == "user":  # after tool results: text in the same turn
        out[-1]["content"].append({"type": "text", "text": draw(texts)})
    else:
        out.append(last)
    return out


@st.composite
def count_tokens_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(models), "messages": draw(anthropic_messages())}
    if draw(st.booleans()):
        body["system"] = draw(
            texts
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": texts}), min_size=1, max_size=2
            )
        )
    if draw(st.booleans()):
        names = draw(st.lists(tool_names, min_size=1, max_size=3, unique=True))
        body["tools"] = [
            {"name": n, "description": draw(texts), "input_schema": draw(schemas)} for n in names
        ]
        choices = st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]) | st.just(
            {"type": "tool", "name": names[0]}
        )
        if draw(st.booleans()):
            body["tool_choice"] = draw(choices)
    return body


@st.composite
def messages_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(count_tokens_bodies())
    body["max_tokens"] = draw(st.integers(1, 48))
    optional = {
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 50),
        "stop_sequences": st.lists(words, max_size=2),
        "metadata": st.fixed_dictionaries({"user_id": texts}),
        "sampling": samplings,
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        body[name] = draw(optional[name])
    if draw(st.booleans()):
        body["stream"] = True
    return body


@st.composite
def responses_input(draw: st.DrawFn) -> str | list[dict[str, Any]]:
    """A Responses ``input``: a string, or items (messages, function calls and their outputs, reasoning)."""
    if draw(st.integers(0, 4)) == 0:
        return str(draw(texts))
    parts = st.lists(
        st.fixed_dictionaries({"type": st.just("input_text"), "text": texts}), min_size=1, max_size=2
    )
    out: list[dict[str, Any]] = []
    if draw(st.booleans()):
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(texts)})
    for i in range(draw(st.integers(0, 2))):
        out.append({"type": "message", "role": "user", "content": draw(texts | parts)})
        if draw(st.booleans()):
            thought = {"type": "reasoning_text", "text": draw(texts)}
            out.append({"type": "reasoning", "id": f"rs_{i}", "summary": [], "content": [thought]})
        text = {"type": "output_text", "text": draw(texts), "annotations": []}
        out.append({"type": "message", "role": "assistant", "content": [text]})
        if draw(st.booleans()):
            call = {"type": "function_call", "call_id": f"call_{i}", "name": draw(tool_names),
                    "arguments": json.dumps(draw(arguments))}  # fmt: skip
            out.append(call)
            out.append(
                {"type": "function_call_output", "call_id": f"call_{i}", "output": draw(texts | parts)}
            )
    out.append({"role": "user", "content": draw(texts | parts)})
    return out


@st.composite
def responses_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(models), "input": draw(responses_input())}
    if draw(st.booleans()):
        names = draw(st.lists(tool_names, min_size=1, max_size=3, unique=True))
        body["tools"] = [
            {"type": "function", "name": n, "description": draw(texts), "parameters": draw(schemas),
             "strict": False}
            for n in names
        ]  # fmt: skip
        choice = st.sampled_from(["auto", "none", "required"]) | st.just(
            {"type": "function", "name": names[0]}
        )
        if draw(st.booleans()):
            body["tool_choice"] = draw(choice)
    optional = {
        "instructions": texts,
        "max_output_tokens": st.integers(1, 48),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "store": st.booleans(),
        "parallel_tool_calls": st.booleans(),
        "truncation": st.sampled_from(["auto", "disabled"]),
        "metadata": st.fixed_dictionaries({"k": words}),
        "sampling": samplings,
        "user": texts,
        "previous_response_id": st.sampled_from(["resp_0", "resp_" + "0" * 25]) | texts,
        "text": st.just({"format": {"type": "text"}}),
        "reasoning": st.just({"effort": "low"}),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        body[name] = draw(optional[name])
    if draw(st.booleans()):
        body["include"] = ["message.output_text.logprobs"]
        body["top_logprobs"] = draw(st.integers(0, 5))
    if draw(st.booleans()):
        body["stream"] = True
    return body


seeds = st.one_of(
    st.integers(0, 2**63 - 1),
    st.sampled_from([0, 2**63 - 1, 2**63, -1, "7", 1.5, True, None, 10**30]),
)
"""A session's seed (keyed sampling): mostly valid (0 to 2^63 - 1), now and then just outside."""
groups = st.one_of(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["", "g" * 199, "g" * 200, "g" * 201, "é" * 200, "🦀" * 200, "__belayer_group"]),
)
"""A session's routing group: mostly valid (1 to 200 characters), now and then just outside."""
session_bodies = st.fixed_dictionaries(
    {},
    optional={"metadata": st.dictionaries(st.text(max_size=8), scalars, max_size=3), "group": groups,
              "seed": seeds},
)  # fmt: skip
reward_bodies = st.fixed_dictionaries(
    {"reward": st.floats(-10, 10)},
    optional={"info": st.dictionaries(st.text(max_size=8), scalars, max_size=2), "override": st.booleans()},
)
fork_bodies = st.fixed_dictionaries(
    {"at_turn": st.one_of(st.just(0), st.integers(-2, 6))},  # mostly 0: a session with one turn forks
    optional={
        "n": st.one_of(st.just(2), st.integers(-1, 40)),
        "metadata": st.dictionaries(st.text(max_size=8), scalars, max_size=2),
    },
)
ODD_URLS = [
    "http://fake-engine", "http://fake-engine/", "http://x/v1", "http://x:99999", "http://x:0", "http://[::1",
    "http://[::1]:8000", "ftp://x", "http://user:pw@x", "http://x?y=1", "http://x#f", "http:///", "x",
    "http://é.example", "http://" + "a" * 300, "HTTP://UPPER", "http://x/%zz",
]  # fmt: skip
# Weight updates: mostly a new version of the tiny model's own weights (a valid update), else paths
# that cannot be loaded and names that are not plain.
_REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_MODEL = str(
    pathlib.Path(os.environ.get("BELAYER_TINY_MODEL", _REPO / ".cache" / "tiny-model")).resolve()
)
ODD_WEIGHT_PATHS = [
    "/nonexistent/ckpt", "relative/ckpt", "/", "/tmp", "", "~", "/dev/null", "/etc/passwd", TINY_MODEL + "/",
    TINY_MODEL + "/config.json", "/" + "a" * 5000, "/x\u0000y", TINY_MODEL + "/..",
]  # fmt: skip
ODD_VERSIONS = ["", " ", "v 1", "-v", "../x", "a" * 129, "é", "v\n1", "base", "\ud800", "{}"]
weights_bodies = st.fixed_dictionaries(
    {
        "version": st.integers(0, 10**9).map(lambda n: f"step-{n}") | st.sampled_from(ODD_VERSIONS),
        "path": st.one_of(st.just(TINY_MODEL), st.just(TINY_MODEL), st.sampled_from(ODD_WEIGHT_PATHS)),
    },
    optional={"drain_s": st.one_of(st.just(0), st.sampled_from([0.0, 0.5, -1, 3601, True, "1", None]))},
)
routing_bodies = st.fixed_dictionaries(
    {},
    optional={
        "routing": st.sampled_from(
            ["affinity", "group", "round-robin", "least-loaded", "Group", "", None, 1]
        ),
        "routing_spill_factor": st.sampled_from(
            [1, 1.0, 2.5, 0.5, 1e7, -1, "2", True, None, float("nan"), float("inf"), 1e400]
        ),
        "routing_spill_floor": st.sampled_from([0, 2, 8192, -1, 2**41, 1.5, "8", False, None]),
    },
)
engine_bodies = st.fixed_dictionaries(
    {"url": st.integers(0, 10**6).map(lambda n: f"http://fuzz-engine-{n}") | st.sampled_from(ODD_URLS)}
)


# --- encodings and plans -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Encoding:
    """How a body goes out: ``json`` (the usual), or one of the ways to send what is not a JSON object."""

    kind: Literal["json", "utf8", "truncate", "random", "empty", "scalar", "bom", "trailing", "oversize"] = (
        "json"
    )
    cut: int = 0
    junk: bytes = b""
    chunk: int = 0
    """Send the bytes in pieces of this size, without a content-length (0: all at once)."""
    hangup: Literal["", "body", "answer"] = ""
    """Disconnect after the first ``cut`` bytes of the body (a client that gave up mid-upload), or
    once the answer has begun (a client that stopped reading a stream)."""

    def bytes_of(self, body: Json, limit: int) -> bytes:
        if self.kind == "random":
            return self.junk
        if self.kind == "empty":
            return self.junk.translate(None, bytes(range(33, 256)))[:8]  # whitespace only, or nothing
        if self.kind == "scalar":
            return [b"[]", b"1", b'"x"', b"null", b"true", b"[{}]"][self.cut % 6]
        if self.kind == "oversize":
            return b'{"pad": "' + b"x" * (limit + self.cut % 1000) + b'"}'
        # "utf8": non-ASCII as UTF-8 bytes, so a lone surrogate becomes bytes that are not UTF-8
        text = encode_json(body, ensure_ascii=self.kind != "utf8")
        raw = text.encode("utf-8", "surrogatepass")
        if self.kind == "truncate":
            return raw[: self.cut % max(1, len(raw))]
        if self.kind == "bom":
            return b"\xef\xbb\xbf" + raw
        if self.kind == "trailing":
            return raw + self.junk
        return raw


ODD_ENCODINGS = ["utf8", "truncate", "random", "empty", "scalar", "bom", "trailing", "oversize"]
encodings = st.builds(
    Encoding,
    kind=st.sampled_from(["json"] * 40 + ODD_ENCODINGS),  # one in six is not JSON
    cut=st.integers(0, 10**6),
    junk=st.binary(max_size=64),
    chunk=st.sampled_from([0, 0, 0, 1, 7, 4096]),
    hangup=st.sampled_from([""] * 30 + ["body", "answer"]),
)

JSON_TYPES = [
    "application/json",
    "application/json; charset=utf-8",
    "application/vnd.api+json",
    "APPLICATION/JSON",
]
OTHER_TYPES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data",
    "text/json",
    "",
    "application/xml",
]
content_types = st.sampled_from(["json"] * 18 + ["variant", "other"]).flatmap(
    lambda kind: (
        st.just("application/json")
        if kind == "json"
        else st.sampled_from([None, *JSON_TYPES] if kind == "variant" else OTHER_TYPES)
    )
)


def is_json_media(content_type: str | None) -> bool:
    if content_type is None:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


# Session ids that are not a session's: never "/", "?", "#", "\\" or a dot segment, which would change
# the route rather than its parameter.
_id_chars = st.characters(codec="utf-8", exclude_characters="/?#\\%", exclude_categories=("Cc", "Cs"))
unknown_ids = st.text(_id_chars, min_size=1, max_size=40).filter(lambda s: s.strip(". ") != "")


@dataclass(frozen=True, slots=True)
class Plan:
    """One request to draw: the route (`ROUTES` key), its valid body and what to do to it."""

    route: str
    body: Json = None
    session: int | str = 0
    """An int selects one of the gateway's sessions at send time; a str is sent as the id."""
    follow_up: bool = False
    """Extend the conversation of the session's last answer on this route, when there is one."""
    mutations: tuple[Mutation, ...] = ()
    encoding: Encoding = field(default_factory=Encoding)
    content_type: str | None = "application/json"
    method: str | None = None
    """A method other than the route's (a 405), or None."""
    auth: str | None = None
    query: str = ""


@dataclass(frozen=True, slots=True)
class RouteSpec:
    method: str
    path: str
    """With ``{sid}`` for a session id, ``{name}`` for an engine's name and ``{rid}`` for a response id."""
    body: st.SearchStrategy[Any] | None = None


ROUTES: dict[str, RouteSpec] = {
    "chat": RouteSpec("POST", "/v1/chat/completions", chat_bodies()),
    "s-chat": RouteSpec("POST", "/s/{sid}/v1/chat/completions", chat_bodies()),
    "completions": RouteSpec("POST", "/v1/completions", completion_bodies()),
    "s-completions": RouteSpec("POST", "/s/{sid}/v1/completions", completion_bodies()),
    "models": RouteSpec("GET", "/v1/models"),
    "s-models": RouteSpec("GET", "/s/{sid}/v1/models"),
    "messages": RouteSpec("POST", "/v1/messages", messages_bodies()),
    "s-messages": RouteSpec("POST", "/s/{sid}/v1/messages", messages_bodies()),
    "count": RouteSpec("POST", "/v1/messages/count_tokens", count_tokens_bodies()),
    "s-count": RouteSpec("POST", "/s/{sid}/v1/messages/count_tokens", count_tokens_bodies()),
    "responses": RouteSpec("POST", "/v1/responses", responses_bodies()),
    "s-responses": RouteSpec("POST", "/s/{sid}/v1/responses", responses_bodies()),
    "get-response": RouteSpec("GET", "/v1/responses/{rid}"),
    "s-get-response": RouteSpec("GET", "/s/{sid}/v1/responses/{rid}"),
    "create-session": RouteSpec("POST", "/api/sessions", session_bodies),
    "list-sessions": RouteSpec("GET", "/api/sessions"),
    "get-session": RouteSpec("GET", "/api/sessions/{sid}"),
    "trajectory": RouteSpec("GET", "/api/sessions/{sid}/trajectory"),
    "reward": RouteSpec("POST", "/api/sessions/{sid}/reward", reward_bodies),
    "close": RouteSpec("POST", "/api/sessions/{sid}/close"),
    "delete-session": RouteSpec("DELETE", "/api/sessions/{sid}"),
    "fork": RouteSpec("POST", "/api/sessions/{sid}/fork", fork_bodies),
    "engines": RouteSpec("GET", "/api/engines"),
    "register-engine": RouteSpec("POST", "/api/engines", engine_bodies),
    "remove-engine": RouteSpec("DELETE", "/api/engines/{name}"),
    "health": RouteSpec("GET", "/health"),
    "dashboard-state": RouteSpec("GET", "/api/dashboard/state"),
    "export": RouteSpec("GET", "/api/export"),
    "export-mark": RouteSpec("POST", "/api/export"),
    "finished": RouteSpec("GET", "/api/finished"),
    "metrics": RouteSpec("GET", "/metrics"),
    "engine-metrics": RouteSpec("GET", "/metrics/engines"),
    "dashboard": RouteSpec("GET", "/dashboard"),
    "weights": RouteSpec("GET", "/api/weights"),
    "update-weights": RouteSpec("POST", "/api/weights", weights_bodies),
    "routing": RouteSpec("GET", "/api/routing"),
    "set-routing": RouteSpec("PUT", "/api/routing", routing_bodies),
}
SANDBOX_ROUTES = [
    ("POST", "/api/sessions/{sid}/sandbox"),
    ("GET", "/api/sessions/{sid}/sandbox"),
    ("DELETE", "/api/sessions/{sid}/sandbox"),
    ("POST", "/api/sessions/{sid}/sandbox/exec"),
    ("GET", "/api/sessions/{sid}/sandbox/files"),
    ("PUT", "/api/sessions/{sid}/sandbox/files"),
    ("GET", "/api/sessions/{sid}/sandbox/checkpoints"),
    ("POST", "/api/sessions/{sid}/sandbox/checkpoints"),
    ("POST", "/api/sessions/{sid}/sandbox/restore"),
    ("POST", "/api/sessions/{sid}/sandbox/verify"),
    ("GET", "/s/{sid}/sandbox"),  # the harness's, under the session's capability URL
    ("POST", "/s/{sid}/sandbox/exec"),
    ("GET", "/s/{sid}/sandbox/files"),
    ("PUT", "/s/{sid}/sandbox/files"),
]
SANDBOX_MAX_READ = 4096
"""``sandbox.max_read_bytes`` of the gateway that the sandbox file plans go to."""
SANDBOX_MAX_JOURNAL = 50_000
"""Its ``sandbox.max_journal_bytes``."""
SANDBOX_PATHS = [
    "/workspace/a", "a", "b/c", "/workspace/one", "/workspace/two", "/workspace/loop", "/workspace/loop/x",
    "/workspace/dir", "/workspace", "", "../etc/passwd", "/etc/passwd", "/workspace/a\x00", "/workspace/é",
    "/workspace/\ud800", " ", "/workspace/big",
]  # fmt: skip
"""File paths: plain, through one link (``one``), two (``two``), a loop, a directory, outside the root."""
SANDBOX_SIZES = [0, 1, SANDBOX_MAX_READ - 1, SANDBOX_MAX_READ, SANDBOX_MAX_READ + 1, 20_000]


@st.composite
def sandbox_write_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A ``PUT .../sandbox/files`` body: sizes about the read and journal limits, both encodings."""
    size = draw(st.sampled_from(SANDBOX_SIZES))
    fill = draw(st.sampled_from(["x", "é", "\u0000", "🦀"]))
    raw = (fill * size).encode()[:size]
    body: dict[str, Any] = {"path": draw(st.sampled_from(SANDBOX_PATHS))}
    if draw(st.booleans()):
        body |= {"content": base64.b64encode(raw).decode(), "encoding": "base64"}
    else:
        body["content"] = raw.decode(errors="ignore")
    if draw(st.booleans()):
        body["mode"] = draw(st.sampled_from([0o644, 0o755, 0, 0o7777, 0o10000, -1]))
    return body


sandbox_read_queries = st.lists(
    st.tuples(
        st.sampled_from(["path", "path", "other"]),
        st.sampled_from([quote(p, errors="surrogatepass") for p in SANDBOX_PATHS]),
    ),
    max_size=2,
).map(lambda pairs: "&".join(f"{k}={v}" for k, v in pairs))
"""A ``GET .../sandbox/files`` query: none, one or two paths, and keys the route does not know."""
ADMIN_ROUTES = frozenset({"register-engine", "remove-engine", "update-weights", "set-routing"})
"""Routes that need the admin token: besides the mutated requests, a third of their draws are clean."""
ADMIN_AUTH = [None, "", "Bearer", "Bearer wrong", "Basic Zm9vOmJhcg==", "bearer  {admin}", "Bearer {admin}x"]
DRAIN = ["0", "0", "0", "", "-1", "3601", "nan", "inf", "1e400", "abc", "0x10", "１"]
WRONG_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
LIST_KEYS = [
    "status", "reward_min", "reward_max", "has_reward", "created_after", "created_before", "limit", "offset",
    "order", "meta.task", "meta.", "meta.%ff", "meta.a%22b", "other", "cursor",
]  # fmt: skip
LIST_VALUES = [
    "", "open", "closed", "x", "-1", "0", "1", "2.5", "1000", "1001", "nan", "inf", "-inf", "1e400", "abc",
    "0x10", "%EF%BC%91", "true", "false", "asc", "desc", "%ff", "%ED%A0%80", "1e-400", "99999999999999999999",
    "WzEuNSwic2VzXzEiXQ", "WzEsMl0", "W251bGwsInMiXQ", "WyJ4IiwicyJd", "e30", "WzFlNDAwLCJzIl0",
]  # fmt: skip
FEED_KEYS = ["after", "after", "limit", "limit", "rows", "other"]
FEED_VALUES = [
    "", "0", "1", "2", "5", "17", "-1", "x", "true", "false", "1e3", "0x10", "%EF%BC%91", "%ff", "%ED%A0%80",
    "99999999999999999999", "9223372036854775807", "9223372036854775808", "1.5", " 3",
]  # fmt: skip
list_queries = st.lists(st.tuples(st.sampled_from(LIST_KEYS), st.sampled_from(LIST_VALUES)), max_size=4).map(
    lambda pairs: "&".join(f"{k}={v}" for k, v in pairs)
)


@st.composite
def plans(draw: st.DrawFn, routes: list[str]) -> Plan:
    """A request for one of ``routes``: mostly valid bodies with up to three mutations."""
    name = draw(st.sampled_from(routes))
    spec = ROUTES[name]
    body = draw(spec.body) if spec.body is not None else None
    known = draw(st.sampled_from([True] * 7 + [False]))
    session: int | str = draw(st.integers(0, 7)) if known else draw(unknown_ids)
    method = draw(st.sampled_from(WRONG_METHODS)) if draw(st.sampled_from([False] * 19 + [True])) else None
    plan = Plan(
        route=name,
        body=body,
        session=session,
        follow_up=draw(st.booleans()),
        mutations=tuple(draw(mutations)) if body is not None else (),
        encoding=draw(encodings) if body is not None else Encoding(),
        content_type=draw(content_types) if body is not None else None,
        method=method if method != spec.method else None,
    )
    if name in ADMIN_ROUTES:
        auth = draw(st.just("Bearer {admin}") | st.just("Bearer {admin}") | st.sampled_from(ADMIN_AUTH))
        query = f"drain_s={draw(st.sampled_from(DRAIN))}" if name == "remove-engine" else ""
        plan = dataclasses.replace(plan, auth=auth, query=query)
        if draw(st.sampled_from([False, False, True])):  # a clean shot: the admin's valid request as drawn
            plan = dataclasses.replace(
                plan, auth="Bearer {admin}", mutations=(), encoding=Encoding(), content_type="application/json",
                method=None,
            )  # fmt: skip
    elif name == "reward":
        auth = draw(st.none() | st.just("Bearer {admin}"))
        plan = dataclasses.replace(plan, auth=auth)
    elif name == "list-sessions":
        plan = dataclasses.replace(plan, query=draw(list_queries))
    elif name in ("export", "export-mark"):
        fmt = draw(
            st.sampled_from(["format=jsonl", "format=parquet", "format=atif", "format=csv", "", "format=%ff"])
        )
        plan = dataclasses.replace(plan, query="&".join(q for q in (fmt, draw(list_queries)) if q))
    elif name == "finished":  # follow=false last, always: a followed feed never ends in-process
        pairs = draw(
            st.lists(st.tuples(st.sampled_from(FEED_KEYS), st.sampled_from(FEED_VALUES)), max_size=3)
        )
        plan = dataclasses.replace(plan, query="&".join([*(f"{k}={v}" for k, v in pairs), "follow=false"]))
    return plan


# --- checks ------------------------------------------------------------------------------------------


def is_anthropic(path: str) -> bool:
    """Whether the gateway answers errors on ``path`` in Anthropic's shape (matched as it decodes it)."""
    return ANTHROPIC_PATH.search(unquote(path)) is not None


def check_openai_error(body: Any, where: str) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, f"{where}: not an OpenAI error: {body!r}"
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, f"{where}: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: no message: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"{where}: no type: {err!r}"
    assert err["param"] is None or isinstance(err["param"], str), f"{where}: param: {err!r}"
    assert err["code"] is None or isinstance(err["code"], str), f"{where}: code: {err!r}"


def check_anthropic_error(body: Any, where: str) -> None:
    assert isinstance(body, dict) and body.get("type") == "error", (
        f"{where}: not an Anthropic error: {body!r}"
    )
    assert set(body) <= {"type", "error", "request_id"}, f"{where}: {body!r}"
    err = body["error"]
    assert isinstance(err, dict) and {"type", "message"} <= set(err), f"{where}: {err!r}"
    assert isinstance(err["type"], str) and err["type"], f"{where}: no type: {err!r}"
    assert isinstance(err["message"], str) and err["message"], f"{where}: no message: {err!r}"


def check_error(path: str, body: Any, where: str) -> None:
    if is_anthropic(path):
        check_anthropic_error(body, where)
    else:
        check_openai_error(body, where)


def sse_events(text: str, where: str) -> list[tuple[str | None, str]]:
    """``(event name, data)`` for each event of an SSE body (asserting every line is SSE)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
            elif line.startswith(("id:", "retry:")):
                continue
            else:
                assert line.startswith(":"), f"{where}: not an SSE line: {line!r}"
        if name is not None or data:  # a block of comments only (a keep-alive) is no event
            events.append((name, "\n".join(data)))
    return events


def is_responses(path: str) -> bool:
    return RESPONSES_PATH.search(unquote(path)) is not None


def check_responses_event(obj: Any, name: str | None, index: int, where: str) -> None:
    """A Responses stream event: named after its type, numbered in order; an ``error`` event has
    OpenAI's ``ResponseErrorEvent`` shape, and ``response.failed`` carries the error."""
    assert isinstance(obj, dict) and obj.get("type") == name, f"{where}: event {name!r}: {obj!r:.300}"
    assert obj.get("sequence_number") == index, (
        f"{where}: event {index} numbered {obj.get('sequence_number')}"
    )
    if name == "error":
        assert set(obj) == {"type", "code", "message", "param", "sequence_number"}, f"{where}: {obj!r}"
        assert isinstance(obj["message"], str) and obj["message"], f"{where}: {obj!r}"
    elif name == "response.failed":
        error = obj["response"]["error"]
        assert isinstance(error, dict) and error["message"] and error["code"], f"{where}: {obj!r:.500}"


def is_error_event(event: Any) -> bool:
    return isinstance(event, dict) and ("error" in event or event.get("type") == "error")


def check_stream(path: str, text: str, where: str) -> list[dict[str, Any]]:
    """The stream's JSON events; error events must have the route's protocol shape."""
    out = []
    anthropic = is_anthropic(path)
    for name, data in sse_events(text, where):
        if data == "[DONE]" and not anthropic:
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            raise AssertionError(f"{where}: an SSE event's data is not JSON: {data[:300]!r}") from None
        if anthropic:
            assert isinstance(obj, dict) and obj.get("type") == name, f"{where}: event {name!r}: {data[:300]}"
            if name == "error":
                check_anthropic_error(obj, where)
        elif is_responses(path):
            check_responses_event(obj, name, len(out), where)
        elif isinstance(obj, dict) and "error" in obj:
            check_openai_error(obj, where)
        out.append(obj)
    return out


def check_answer(
    method: str, path: str, r: httpx.Response, where: str, allow_5xx: frozenset[int] = frozenset()
) -> Any:
    """What every answer must be: under 500 (or one of `allow_5xx`), JSON (or SSE), errors in the
    route's protocol shape. Returns the JSON body (a list of events for a stream; None when empty)."""
    # with failing engines, a request convicted of killing them is documented too (gateway.turns.quarantine)
    # (OpenAI's shape names the code; Anthropic's has none: its message and the no-retry header say it)
    convicted = b'"code":"request_killed_workers"' in r.content or (
        r.headers.get("x-should-retry") == "false" and b"query of death" in r.content
    )
    killed = bool(allow_5xx) and r.status_code == 500 and convicted
    assert r.status_code < 500 or r.status_code in allow_5xx or killed, (
        f"{where}: {r.status_code}: {r.text[:2000]}"
    )
    media = r.headers.get("content-type", "")
    if media.startswith("text/event-stream"):
        assert r.status_code == 200, f"{where}: a stream with status {r.status_code}"
        return check_stream(path, r.text, where)
    if method == "HEAD" or (not r.content and r.status_code < 400):
        return None
    if r.status_code < 400 and media.startswith("text/plain") and path.startswith("/metrics"):
        return list(text_string_to_metric_families(r.text))  # Prometheus text that parses
    if r.status_code < 400 and media.startswith("text/html") and path.startswith("/dashboard"):
        return r.text
    if r.status_code < 400 and path == "/api/export":
        if media.startswith("application/x-ndjson"):
            return [json.loads(line) for line in r.text.splitlines()]
        assert media.startswith("application/vnd.apache.parquet") and r.content[:4] == b"PAR1", where
        return None
    assert media.startswith("application/json"), f"{where}: {r.status_code} as {media!r}: {r.text[:500]}"
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(
            f"{where}: {r.status_code} with a body that is not JSON: {r.text[:500]!r}"
        ) from None
    if r.status_code >= 400:
        check_error(path, body, where)
    return body
