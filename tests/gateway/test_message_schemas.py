"""Messages follow the providers' own per-role schemas: a message (or Anthropic block) that lacks a field
its role requires, or carries one that role cannot have, gets the provider's 400 in its wording.

The wording, params and codes mirror answers the real APIs gave (quoted in public bug reports):
OpenAI's ``Unknown parameter: 'messages[0].tool_calls'.`` (``unknown_parameter``), ``Missing required
parameter: 'messages[3].content[0].type'.``, ``Invalid value: 'image'. Supported values are: 'text' and
'image_url'.`` (``invalid_value``), ``Invalid type for 'messages[1].content': expected one of a string
or array of objects, but got an object instead.``, ``Missing parameter 'tool_call_id': messages with
role 'tool' must have a 'tool_call_id'.`` (param ``messages.[3].tool_call_id``) and ``Invalid value for
'content': expected a string, got null.`` (param ``messages.[0].content``); Anthropic's
``messages.2.content.0.tool_result.tool_use_id: Field required``, ``messages.65.content.1.tool_use.text:
Extra inputs are not permitted`` and ``messages.9: `tool_result` blocks can only be in `user` messages``.

Real harness traffic keeps working: a tool-call round trip on each protocol, with the extra fields
harnesses send (``reasoning_content``, ``name`` on a tool message, a tool call's ``index``, null fields,
``cache_control``), and the gateway's own ``"content": null`` answer sent back.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway import fuzzing
from tests.support import GatewayHarness

CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
CALL = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
USE = {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}
THINKING = {"type": "thinking", "thinking": "hm", "signature": "sig"}
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": SCHEMA}}]


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": list(messages), **extra}


def user(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"role": "user", "content": content, **extra}


def assistant(content: Any = None, **extra: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content, **extra}


def tool(**extra: Any) -> dict[str, Any]:
    return {"role": "tool", "content": "a.py", "tool_call_id": "call_1", **extra}


def without(message: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != key}


def call(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(CALL)
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


# (name, body, param, code, message)
OPENAI: list[tuple[str, dict[str, Any], str, str | None, str]] = [
    ("user with tool_call_id", chat(user(tool_call_id="call_1")), "messages[0].tool_call_id",
     "unknown_parameter", "Unknown parameter: 'messages[0].tool_call_id'."),
    ("user with tool_calls", chat(user(tool_calls=[CALL])), "messages[0].tool_calls", "unknown_parameter",
     "Unknown parameter: 'messages[0].tool_calls'."),
    ("system with tool_calls", chat({"role": "system", "content": "s", "tool_calls": [CALL]}, user()),
     "messages[0].tool_calls", "unknown_parameter", "Unknown parameter: 'messages[0].tool_calls'."),
    ("developer with refusal", chat({"role": "developer", "content": "s", "refusal": "no"}, user()),
     "messages[0].refusal", "unknown_parameter", "Unknown parameter: 'messages[0].refusal'."),
    ("tool with tool_calls", chat(user(), assistant(tool_calls=[CALL]), tool(tool_calls=[CALL])),
     "messages[2].tool_calls", "unknown_parameter", "Unknown parameter: 'messages[2].tool_calls'."),
    ("tool with function_call", chat(user(), assistant(tool_calls=[CALL]),
                                     tool(function_call={"name": "f", "arguments": "{}"})),
     "messages[2].function_call", "unknown_parameter", "Unknown parameter: 'messages[2].function_call'."),
    ("user with audio", chat(user(audio={"id": "a"})), "messages[0].audio", "unknown_parameter",
     "Unknown parameter: 'messages[0].audio'."),
    ("assistant with tool_call_id", chat(user(), assistant("x", tool_call_id="call_1"), user()),
     "messages[1].tool_call_id", "unknown_parameter", "Unknown parameter: 'messages[1].tool_call_id'."),
    ("user without content", chat({"role": "user"}), "messages[0].content", "missing_required_parameter",
     "Missing required parameter: 'messages[0].content'."),
    ("system without content", chat({"role": "system"}, user()), "messages[0].content",
     "missing_required_parameter", "Missing required parameter: 'messages[0].content'."),
    ("tool without content", chat(user(), assistant(tool_calls=[CALL]), without(tool(), "content")),
     "messages[2].content", "missing_required_parameter", "Missing required parameter: 'messages[2].content'."),
    ("user with null content", chat(user(None)), "messages.[0].content", None,
     "Invalid value for 'content': expected a string, got null."),
    ("user content an object", chat(user({"text": "hi"})), "messages[0].content", "invalid_type",
     "Invalid type for 'messages[0].content': expected one of a string or array of objects, "
     "but got an object instead."),
    ("tool without tool_call_id", chat(user(), assistant(tool_calls=[CALL]), without(tool(), "tool_call_id")),
     "messages.[2].tool_call_id", None,
     "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."),
    ("content part without type", chat(user([{"text": "hi"}])), "messages[0].content[0].type",
     "missing_required_parameter", "Missing required parameter: 'messages[0].content[0].type'."),
    ("system with an image part", chat({"role": "system", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}, user()), "messages[0].content[0].type",
     "invalid_value", "Invalid value: 'image_url'. Supported values are: 'text'."),
    ("tool with an image part", chat(user(), assistant(tool_calls=[CALL]), tool(content=[
        {"type": "image_url", "image_url": {"url": "x"}}])), "messages[2].content[0].type", "invalid_value",
     "Invalid value: 'image_url'. Supported values are: 'text'."),
    ("user with a refusal part", chat(user([{"type": "refusal", "refusal": "no"}])),
     "messages[0].content[0].type", "invalid_value",
     "Invalid value: 'refusal'. Supported values are: 'text', 'image_url', 'input_audio', and 'file'."),
    ("assistant with an image part", chat(user(), assistant([{"type": "image_url", "image_url": {"url": "x"}}]),
                                          user()), "messages[1].content[0].type", "invalid_value",
     "Invalid value: 'image_url'. Supported values are: 'text' and 'refusal'."),
    ("tool call without id", chat(user(), assistant(tool_calls=[call(id=None)]), tool()),
     "messages[1].tool_calls[0].id", "missing_required_parameter",
     "Missing required parameter: 'messages[1].tool_calls[0].id'."),
    ("tool call without type", chat(user(), assistant(tool_calls=[call(type=None)]), tool()),
     "messages[1].tool_calls[0].type", "missing_required_parameter",
     "Missing required parameter: 'messages[1].tool_calls[0].type'."),
    ("tool call of another type", chat(user(), assistant(tool_calls=[call(type="web")]), tool()),
     "messages[1].tool_calls[0].type", "invalid_value",
     "Invalid value: 'web'. Supported values are: 'function' and 'custom'."),
    ("tool call without function", chat(user(), assistant(tool_calls=[call(function=None)]), tool()),
     "messages[1].tool_calls[0].function", "missing_required_parameter",
     "Missing required parameter: 'messages[1].tool_calls[0].function'."),
    ("tool call without name", chat(user(), assistant(tool_calls=[call(function={"arguments": "{}"})]), tool()),
     "messages[1].tool_calls[0].function.name", "missing_required_parameter",
     "Missing required parameter: 'messages[1].tool_calls[0].function.name'."),
    ("tool call without arguments", chat(user(), assistant(tool_calls=[call(function={"name": "bash"})]), tool()),
     "messages[1].tool_calls[0].function.arguments", "missing_required_parameter",
     "Missing required parameter: 'messages[1].tool_calls[0].function.arguments'."),
    ("tool call arguments an object", chat(user(), assistant(tool_calls=[
        call(function={"name": "bash", "arguments": {"command": "ls"}})]), tool()),
     "messages[1].tool_calls[0].function.arguments", "invalid_type",
     "Invalid type for 'messages[1].tool_calls[0].function.arguments': expected a string, "
     "but got an object instead."),
    ("tool_calls not an array", chat(user(), assistant(tool_calls=CALL), tool()), "messages[1].tool_calls",
     "invalid_type", "Invalid type for 'messages[1].tool_calls': expected an array, but got an object instead."),
    ("function message without name", chat(user(), {"role": "function", "content": "x"}),
     "messages[1].name", "missing_required_parameter", "Missing required parameter: 'messages[1].name'."),
]  # fmt: skip


def messages(*msgs: dict[str, Any]) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 16, "messages": [*msgs, {"role": "user", "content": "go on"}]}


def said(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": list(blocks)}


def asked(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def block(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


# (name, body, message)
ANTHROPIC: list[tuple[str, dict[str, Any], str]] = [
    ("tool_use without id", messages(said(block(USE, id=None))), "messages.0.content.0.tool_use.id: Field required"),
    ("tool_use without name", messages(said(block(USE, name=None))), "messages.0.content.0.tool_use.name: Field required"),
    ("tool_use without input", messages(said(block(USE, input=None))),
     "messages.0.content.0.tool_use.input: Field required"),
    ("tool_use input not an object", messages(said(block(USE, input="ls"))),
     "messages.0.content.0.tool_use.input: Input should be a valid dictionary"),
    ("tool_use with text", messages(said(block(USE, text="x"))),
     "messages.0.content.0.tool_use.text: Extra inputs are not permitted"),
    ("tool_use with tool_use_id", messages(said(block(USE, tool_use_id="toolu_1"))),
     "messages.0.content.0.tool_use.tool_use_id: Extra inputs are not permitted"),
    ("tool_use in a user message", messages(asked(USE)),
     "messages.0: `tool_use` blocks can only be in `assistant` messages"),
    ("tool_result without tool_use_id", messages(said(USE), asked(block(RESULT, tool_use_id=None))),
     "messages.1.content.0.tool_result.tool_use_id: Field required"),
    ("tool_result with id", messages(said(USE), asked(block(RESULT, id="toolu_1"))),
     "messages.1.content.0.tool_result.id: Extra inputs are not permitted"),
    ("tool_result is_error not a bool", messages(said(USE), asked(block(RESULT, is_error="yes"))),
     "messages.1.content.0.tool_result.is_error: Input should be a valid boolean"),
    ("tool_result text without text", messages(said(USE), asked(block(RESULT, content=[{"type": "text"}]))),
     "messages.1.content.0.tool_result.content.0.text.text: Field required"),
    ("tool_result in an assistant message", messages(said(USE, RESULT)),
     "messages.0: `tool_result` blocks can only be in `user` messages"),
    ("text without text", messages(asked({"type": "text"})), "messages.0.content.0.text.text: Field required"),
    ("text not a string", messages(asked({"type": "text", "text": 5})),
     "messages.0.content.0.text.text: Input should be a valid string"),
    ("text with input", messages(asked({"type": "text", "text": "x", "input": {}})),
     "messages.0.content.0.text.input: Extra inputs are not permitted"),
    ("thinking without signature", messages(said(block(THINKING, signature=None), {"type": "text", "text": "x"})),
     "messages.0.content.0.thinking.signature: Field required"),
    ("thinking without thinking", messages(said(block(THINKING, thinking=None))),
     "messages.0.content.0.thinking.thinking: Field required"),
    ("thinking with text", messages(said(block(THINKING, text="x"))),
     "messages.0.content.0.thinking.text: Extra inputs are not permitted"),
    ("thinking in a user message", messages(asked(THINKING)),
     "messages.0: `thinking` blocks can only be in `assistant` messages"),
    ("redacted_thinking without data", messages(said({"type": "redacted_thinking"})),
     "messages.0.content.0.redacted_thinking.data: Field required"),
    ("image without source", messages(asked({"type": "image"})), "messages.0.content.0.image.source: Field required"),
    ("message without content", messages({"role": "user"}), "messages.0.content: Field required"),
    ("OpenAI tool_calls on an assistant message", messages({"role": "assistant", "content": "x",
                                                            "tool_calls": [CALL]}),
     "messages.0.tool_calls: Extra inputs are not permitted"),
    ("OpenAI tool_call_id on a user message", messages({"role": "user", "content": "x", "tool_call_id": "c"}),
     "messages.0.tool_call_id: Extra inputs are not permitted"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "message"), ANTHROPIC, ids=[c[0] for c in ANTHROPIC])
async def test_anthropic_message_schemas(
    gateway: GatewayHarness, name: str, body: dict[str, Any], message: str
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = await gateway.client.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}
    assert gateway.engine.requests == []


# --- real harness traffic still goes through ------------------------------------------------------------


async def test_openai_tool_call_round_trip_as_harnesses_send_it(gateway: GatewayHarness) -> None:
    """litellm-based harnesses (OpenHands, mini-swe-agent) send the reply back as the SDK dumps it: null
    fields, ``index``, ``reasoning_content``, ``provider_specific_fields``; and ``name`` on tool messages."""
    gateway.queue_replies(CALL_TEXT, "done", "ok")
    first = [{"role": "system", "content": "s", "name": "sys"},
             user([{"type": "text", "text": "list", "cache_control": {"type": "ephemeral"}}])]  # fmt: skip
    r = await gateway.client.post("/v1/chat/completions", json=chat(*first, tools=TOOLS))
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]
    calls = [{**c, "index": k} for k, c in enumerate(reply["tool_calls"])]
    echoed = assistant(reply["content"], tool_calls=calls, function_call=None, refusal=None, audio=None,
                       reasoning_content=None, provider_specific_fields={}, name=None)  # fmt: skip
    result = tool(tool_call_id=calls[0]["id"], name="bash", tool_calls=None)
    r = await gateway.client.post("/v1/chat/completions", json=chat(*first, echoed, result, tools=TOOLS))
    assert r.status_code == 200, r.text
    # the gateway answers an empty turn with "content": null and no tool calls (serving's
    # ``done.content or None``); a harness sends that back, with the reasoning it came with
    empty = {"role": "assistant", "content": None, "reasoning_content": "hm"}
    again = chat(*first, echoed, result, user("more"), empty, user("go"), tools=TOOLS)
    r = await gateway.client.post("/v1/chat/completions", json=again)
    assert r.status_code == 200, r.text


async def test_anthropic_tool_call_round_trip_as_claude_code_sends_it(gateway: GatewayHarness) -> None:
    """Claude Code sends back the blocks it got, cache_control on the last blocks, a tool_result with
    ``is_error``, a thinking block with its signature and a mid-conversation system message."""
    gateway.queue_replies(CALL_TEXT, "done")
    first = {
        "role": "user",
        "content": [{"type": "text", "text": "list", "cache_control": {"type": "ephemeral"}}],
    }
    tools = [{"name": "bash", "description": "run", "input_schema": SCHEMA}]
    body = {"model": "policy", "max_tokens": 32, "messages": [first], "tools": tools}
    r = await gateway.client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    [use] = [b for b in content if b["type"] == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": use["id"], "is_error": False, "cache_control": {"type": "ephemeral"},
              "content": [{"type": "text", "text": "a.py"}]}  # fmt: skip
    body["messages"] = [
        first,
        {"role": "assistant", "content": [THINKING, *content]},
        {"role": "user", "content": [result, {"type": "text", "text": "go on"}]},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "and?"},
    ]
    for path in ("/v1/messages/count_tokens", "/v1/messages"):
        r = await gateway.client.post(path, json=body)
        assert r.status_code == 200, r.text


# --- under the fuzzer ------------------------------------------------------------------------------------

OPENAI_ROLE_ONLY = {"tool_calls": [CALL], "tool_call_id": "call_x", "function_call": {"name": "f"},
                    "refusal": "no", "audio": {"id": "a"}}  # fmt: skip
OPENAI_OWN = {"assistant": {"tool_calls", "function_call", "refusal", "audio"}, "tool": {"tool_call_id"}}


@st.composite
def openai_faults(draw: st.DrawFn) -> tuple[dict[str, Any], str, str]:
    """A valid chat body (the fuzzer's) with one per-role fault: (body, param, message)."""
    msgs = draw(fuzzing.openai_messages())
    i = draw(st.integers(0, len(msgs) - 1))
    m, role = msgs[i], msgs[i]["role"]
    foreign = sorted(set(OPENAI_ROLE_ONLY) - OPENAI_OWN.get(role, set()))
    kind = draw(st.sampled_from(["foreign", "missing"]))
    if kind == "foreign":
        key = draw(st.sampled_from(foreign))
        m[key] = OPENAI_ROLE_ONLY[key]
        param, text = f"messages[{i}].{key}", f"Unknown parameter: 'messages[{i}].{key}'."
    elif role == "assistant" and m.get("tool_calls"):
        field = draw(st.sampled_from(["id", "type", "function"]))
        del m["tool_calls"][0][field]
        param = f"messages[{i}].tool_calls[0].{field}"
        text = f"Missing required parameter: '{param}'."
    elif role == "tool" and draw(st.booleans()):
        del m["tool_call_id"]
        param = f"messages.[{i}].tool_call_id"
        text = "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'."
    elif role != "assistant":
        del m["content"]
        param, text = f"messages[{i}].content", f"Missing required parameter: 'messages[{i}].content'."
    else:  # an assistant message with text only: a tool message's field instead
        m["tool_call_id"] = "call_x"
        param, text = f"messages[{i}].tool_call_id", f"Unknown parameter: 'messages[{i}].tool_call_id'."
    return {"model": "policy", "messages": msgs, "stream": draw(st.booleans())}, param, text


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip


@FUZZ
@given(case=openai_faults())
async def test_openai_per_role_faults_get_openais_400(
    gateway: GatewayHarness, case: tuple[dict[str, Any], str, str]
) -> None:
    body, param, text = case
    r = await gateway.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, f"{json.dumps(body)[:800]} -> {r.status_code} {r.text[:500]}"
    fuzzing.check_answer("POST", "/v1/chat/completions", r, json.dumps(body)[:800])
    assert (r.json()["error"]["param"], r.json()["error"]["message"]) == (param, text), json.dumps(body)[:800]


BLOCK_FOREIGN = {"text": ["input", "tool_use_id", "signature"], "thinking": ["text", "id", "content"],
                 "tool_use": ["text", "tool_use_id", "is_error"], "tool_result": ["id", "name", "text"]}  # fmt: skip
BLOCK_REQUIRED = {"text": ["text"], "thinking": ["thinking", "signature"], "tool_use": ["id", "name", "input"],
                  "tool_result": ["tool_use_id"]}  # fmt: skip
WRONG_ROLE = {
    "tool_use": ("user", "assistant"),
    "thinking": ("user", "assistant"),
    "tool_result": ("assistant", "user"),
}
MOVED: dict[str, dict[str, Any]] = {"tool_use": USE, "thinking": THINKING, "tool_result": RESULT}


@st.composite
def anthropic_faults(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A valid Messages body (the fuzzer's) with one per-role fault: (body, message)."""
    msgs = draw(fuzzing.anthropic_messages())
    places = [
        (i, j) for i, m in enumerate(msgs) if isinstance(m["content"], list) for j in range(len(m["content"]))
    ]
    kind = draw(st.sampled_from(["missing", "foreign", "role", "content"]))
    if kind == "content" or not places:
        i = draw(st.integers(0, len(msgs) - 1))
        del msgs[i]["content"]
        text = f"messages.{i}.content: Field required"
    elif kind == "role":
        moved = draw(st.sampled_from(sorted(WRONG_ROLE)))
        wrong, right = WRONG_ROLE[moved]
        i = draw(st.sampled_from([k for k, m in enumerate(msgs) if m["role"] == wrong] or [-1]))
        if i < 0:  # no message of that role: a message without content instead
            i = len(msgs) - 1
            del msgs[i]["content"]
            text = f"messages.{i}.content: Field required"
        else:
            content = msgs[i]["content"]
            msgs[i]["content"] = [{"type": "text", "text": content}] if isinstance(content, str) else content
            msgs[i]["content"].insert(0, dict(MOVED[moved]))
            text = f"messages.{i}: `{moved}` blocks can only be in `{right}` messages"
    else:
        i, j = draw(st.sampled_from(places))
        b = msgs[i]["content"][j]
        where = f"messages.{i}.content.{j}.{b['type']}"
        if kind == "missing":
            key = draw(st.sampled_from(BLOCK_REQUIRED[b["type"]]))
            del b[key]
            text = f"{where}.{key}: Field required"
        else:
            key = draw(st.sampled_from(BLOCK_FOREIGN[b["type"]]))
            b[key] = "x"
            text = f"{where}.{key}: Extra inputs are not permitted"
    return {"model": "policy", "max_tokens": 16, "messages": msgs, "stream": draw(st.booleans())}, text


@FUZZ
@given(case=anthropic_faults())
async def test_anthropic_per_role_faults_get_anthropics_400(
    gateway: GatewayHarness, case: tuple[dict[str, Any], str]
) -> None:
    body, text = case
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = await gateway.client.post(path, json=body)
        assert r.status_code == 400, f"{json.dumps(body)[:800]} -> {r.status_code} {r.text[:500]}"
        fuzzing.check_answer("POST", path, r, json.dumps(body)[:800])
        assert r.json()["error"]["message"] == text, json.dumps(body)[:800]


ODD = [
    ("/v1/chat/completions", chat({"role": {"model": "system"}, "content": "?"}, user())),
    ("/v1/chat/completions", chat(user([{"type": {"a": 1}, "text": "x"}]))),
    ("/v1/chat/completions", chat(user(), assistant(tool_calls=[call(type=["function"])]))),
    ("/v1/messages", messages({"role": ["user"], "content": "x"})),
    ("/v1/messages", messages(asked({"type": {"text": 1}, "text": "x"}))),
    ("/v1/messages", messages(said(USE), asked(block(RESULT, content=[{"type": [], "text": "x"}])))),
]


@pytest.mark.parametrize(("path", "body"), ODD)
async def test_any_json_where_a_role_or_type_goes_is_a_400(
    gateway: GatewayHarness, path: str, body: dict[str, Any]
) -> None:
    """A role or a type that is an object or an array (unhashable: a TypeError once, found by the fuzzer)."""
    r = await gateway.client.post(path, json=body)
    assert r.status_code == 400, r.text
    fuzzing.check_answer("POST", path, r, path)


# --- Responses: each input item's type and role ------------------------------------------------------


def inputs(*items: dict[str, Any]) -> dict[str, Any]:
    return {"model": "policy", "input": [*items, {"role": "user", "content": "go on"}]}


FC = {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": "{}"}
FCO = {"type": "function_call_output", "call_id": "call_1", "output": "a.py"}
RESPONSES: list[tuple[str, dict[str, Any], str, str, str]] = [
    ("assistant with an input_text part", inputs({"role": "assistant", "content": [
        {"type": "input_text", "text": "x"}]}), "input[0].content[0]", "invalid_value",
     "Invalid value: 'input_text'. Supported values are: 'output_text' and 'refusal'."),
    ("user with an output_text part", inputs({"role": "user", "content": [{"type": "output_text", "text": "x"}]}),
     "input[0].content[0]", "invalid_value",
     "Invalid value: 'output_text'. Supported values are: 'input_text', 'input_image', and 'input_file'."),
    ("developer with a refusal part", inputs({"type": "message", "role": "developer", "content": [
        {"type": "refusal", "refusal": "no"}]}), "input[0].content[0]", "invalid_value",
     "Invalid value: 'refusal'. Supported values are: 'input_text', 'input_image', and 'input_file'."),
    ("message without content", inputs({"type": "message", "role": "user"}), "input[0].content",
     "missing_required_parameter", "Missing required parameter: 'input[0].content'."),
    ("message without role", inputs({"type": "message", "content": "x"}), "input[0].role",
     "missing_required_parameter", "Missing required parameter: 'input[0].role'."),
    ("message with call_id", inputs({"role": "user", "content": "x", "call_id": "call_1"}), "input[0].call_id",
     "unknown_parameter", "Unknown parameter: 'input[0].call_id'."),
    ("function_call with output", inputs({**FC, "output": "a.py"}, FCO), "input[0].output", "unknown_parameter",
     "Unknown parameter: 'input[0].output'."),
    ("function_call_output with arguments", inputs(FC, {**FCO, "arguments": "{}"}), "input[1].arguments",
     "unknown_parameter", "Unknown parameter: 'input[1].arguments'."),
    ("function_call_output with role", inputs(FC, {**FCO, "role": "tool"}), "input[1].role", "unknown_parameter",
     "Unknown parameter: 'input[1].role'."),
    ("reasoning with arguments", inputs({"type": "reasoning", "summary": [], "arguments": "{}"}),
     "input[0].arguments", "unknown_parameter", "Unknown parameter: 'input[0].arguments'."),
]  # fmt: skip


OPENAI_ROUTES = [("/v1/chat/completions", *case) for case in OPENAI] + [
    ("/v1/responses", *case) for case in RESPONSES
]


@pytest.mark.parametrize(
    ("url", "name", "body", "param", "code", "message"),
    OPENAI_ROUTES,
    ids=[f"{c[0]}:{c[1]}" for c in OPENAI_ROUTES],
)
async def test_openai_message_and_item_schemas(
    gateway: GatewayHarness,
    url: str,
    name: str,
    body: dict[str, Any],
    param: str,
    code: str | None,
    message: str,
) -> None:
    r = await gateway.client.post(url, json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }
    assert gateway.engine.requests == []


async def test_responses_function_call_round_trip_as_codex_sends_it(gateway: GatewayHarness) -> None:
    """Codex sends its history back: developer and user messages of input_text parts, the assistant's
    output_text, the reasoning item, the function call with its id and status, and its output."""
    gateway.queue_replies(CALL_TEXT, "done")
    tools = [
        {"type": "function", "name": "bash", "description": "run", "parameters": SCHEMA, "strict": False}
    ]
    first = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be careful"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
    ]
    body = {"model": "policy", "input": first, "tools": tools, "store": False}
    r = await gateway.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    [fc] = [o for o in output if o["type"] == "function_call"]
    said = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
    }
    result = {"type": "function_call_output", "call_id": fc["call_id"], "output": "a.py"}
    body["input"] = [*first, {"type": "reasoning", "summary": [], "content": None, "encrypted_content": None},
                     said, *output, result]  # fmt: skip
    r = await gateway.client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
