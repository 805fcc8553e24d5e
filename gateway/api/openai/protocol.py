"""OpenAI wire models (requests). Unknown fields are allowed and ignored unless they change the result;
those are listed in ``UNSUPPORTED`` and rejected with a 400 that names them.

Messages follow OpenAI's per-role schemas (``check_messages``, run before the model validates): a
message that lacks a field its role requires, carries a field only another role has, or holds a
content part its role cannot send gets the 400 OpenAI gives, in its wording, ``param`` and ``code``.
Leniency, where the gateway's own traffic or real harnesses need it: an assistant message may have
neither content nor tool calls (this gateway answers ``"content": null`` for an empty turn, and
harnesses send it back), a field no role has is ignored, and a null field counts as absent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.errors import InvalidRequest


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_Wire):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Wire):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Wire):
    type: str
    text: str | None = None


class Message(_Wire):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant's reasoning, as this gateway (and vLLM) sends it
    reasoning: str | None = None  # the same, by vLLM's newer name


class FunctionDef(_Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Wire):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Wire):
    name: str


class NamedToolChoice(_Wire):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Wire):
    include_usage: bool = False


class ChatCompletionRequest(_Wire):
    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    parallel_tool_calls: bool | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _per_role(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_messages(data.get("messages"))
        return data


class CompletionRequest(_Wire):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None


# Fields that would change the result and that Belayer does not implement: reject rather than ignore.
UNSUPPORTED: dict[str, str] = {
    "functions": "the legacy 'functions' field is not supported; send 'tools' instead",
    "function_call": "the legacy 'function_call' field is not supported; send 'tool_choice' instead",
    "response_format": "'response_format' (structured output) is not supported; describe the format in the prompt",
    "logit_bias": "'logit_bias' is not supported; remove it",
    "audio": "audio output is not supported by this text model; remove 'audio'",
    "modalities": "only text output is supported; remove 'modalities'",
    "prediction": "predicted outputs are not supported; remove 'prediction'",
    "best_of": "'best_of' is not supported; remove it",
    "suffix": "'suffix' (insertion) is not supported; remove it",
}


# --- per-role message schemas ------------------------------------------------------------------------
# Each role's fields, as the OpenAI API defines them (the openai SDK's ChatCompletion*MessageParam).
# A field of another role is refused as OpenAI refuses it ("Unknown parameter"); a field no role has
# (``reasoning_content``, ``cache_control``, litellm's ``provider_specific_fields``…) is let through, as
# are ``name`` on a tool message (OpenHands sends it) and a null value (an SDK's dump of an absent one).
ROLE_FIELDS: dict[str, frozenset[str]] = {
    "system": frozenset({"content", "name"}),
    "developer": frozenset({"content", "name"}),
    "user": frozenset({"content", "name"}),
    "assistant": frozenset({"content", "name", "tool_calls", "function_call", "refusal", "audio"}),
    "tool": frozenset({"content", "tool_call_id", "name"}),
    "function": frozenset({"content", "name"}),
}
_ROLE_ONLY = frozenset().union(*ROLE_FIELDS.values()) - {"content", "name"}
PART_TYPES: dict[str, tuple[str, ...]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}
"""The content part types each role may send (``function`` content is a string)."""


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    names = {str: "a string", list: "an array", dict: "an object", type(None): "null"}
    return names.get(type(value), "an object")


def one_of(values: tuple[str, ...]) -> str:
    """OpenAI's list of supported values: ``'a'``, ``'a' and 'b'``, ``'a', 'b', and 'c'``."""
    quoted = [f"'{v}'" for v in values]
    if len(quoted) < 3:
        return " and ".join(quoted)
    return ", ".join(quoted[:-1]) + ", and " + quoted[-1]


def _missing(param: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")


def _invalid_type(param: str, expected: str, value: Any) -> InvalidRequest:
    return InvalidRequest(
        f"Invalid type for '{param}': expected {expected}, but got {_json_type(value)} instead.",
        param,
        "invalid_type",
    )


def _invalid_value(param: str, value: Any, supported: tuple[str, ...]) -> InvalidRequest:
    return InvalidRequest(
        f"Invalid value: {repr(value)[:200]}. Supported values are: {one_of(supported)}.",
        param,
        "invalid_value",
    )


def check_messages(messages: Any) -> None:
    """Each message against its role's schema, with OpenAI's 400 for the first fault:

    >>> check_messages([{"role": "user", "content": "hi", "tool_call_id": "call_1"}])
    Traceback (most recent call last):
    ...
    core.errors.InvalidRequest: Unknown parameter: 'messages[0].tool_call_id'.

    What is not a list of objects with a known role is left to the model's own validation."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if isinstance(role, str) and role in ROLE_FIELDS:  # (a role may be any JSON: unhashable)
            _check_message(message, role, f"messages[{i}]", i)


def _check_message(message: dict[str, Any], role: str, where: str, i: int) -> None:
    for key in sorted(_ROLE_ONLY - ROLE_FIELDS[role]):
        if message.get(key) is not None:
            raise InvalidRequest(
                f"Unknown parameter: '{where}.{key}'.", f"{where}.{key}", "unknown_parameter"
            )
    if role == "assistant":
        _check_tool_calls(message.get("tool_calls"), f"{where}.tool_calls")
    elif "content" not in message:
        raise _missing(f"{where}.content")
    elif message["content"] is None and role != "function":
        # OpenAI's own wording and its older "messages.[i]" path for this one
        raise InvalidRequest(
            "Invalid value for 'content': expected a string, got null.", f"messages.[{i}].content"
        )
    if role == "tool" and message.get("tool_call_id") is None:
        raise InvalidRequest(
            "Missing parameter 'tool_call_id': messages with role 'tool' must have a 'tool_call_id'.",
            f"messages.[{i}].tool_call_id",
        )
    if role == "function":
        _check_function_message(message, where)
    else:
        _check_content(message.get("content"), PART_TYPES[role], f"{where}.content")


def _check_content(content: Any, types: tuple[str, ...], where: str) -> None:
    if content is None or isinstance(content, str):
        return  # an assistant's null content: see the module's note on leniency
    if not isinstance(content, list):
        raise _invalid_type(where, "one of a string or array of objects", content)
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _invalid_type(f"{where}[{j}]", "an object", part)
        if "type" not in part:
            raise _missing(f"{where}[{j}].type")
        if part["type"] not in types:
            raise _invalid_value(f"{where}[{j}].type", part["type"], types)


def _check_tool_calls(calls: Any, where: str) -> None:
    if calls is None:
        return
    if not isinstance(calls, list):
        raise _invalid_type(where, "an array", calls)
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _invalid_type(at, "an object", call)
        for key in ("id", "type"):
            if key not in call:
                raise _missing(f"{at}.{key}")
        if call["type"] not in ("function", "custom"):
            raise _invalid_value(f"{at}.type", call["type"], ("function", "custom"))
        if call["type"] == "custom":
            raise InvalidRequest(
                "custom tool calls are not supported; send function tool calls",
                f"{at}.type",
                "unsupported_parameter",
            )
        _check_function(call.get("function"), f"{at}.function")


def _check_function(function: Any, where: str) -> None:
    if function is None:
        raise _missing(where)
    if not isinstance(function, dict):
        raise _invalid_type(where, "an object", function)
    for key in ("name", "arguments"):
        if key not in function:
            raise _missing(f"{where}.{key}")
        if not isinstance(function[key], str):
            raise _invalid_type(f"{where}.{key}", "a string", function[key])


def _check_function_message(message: dict[str, Any], where: str) -> None:
    if "name" not in message:
        raise _missing(f"{where}.name")
    content = message["content"]
    if content is not None and not isinstance(content, str):
        raise _invalid_type(f"{where}.content", "a string", content)
    raise InvalidRequest(
        "messages with role 'function' (legacy function calling) are not supported; send the result as a "
        "'tool' message with its 'tool_call_id'",
        f"{where}.role",
        "unsupported_parameter",
    )
