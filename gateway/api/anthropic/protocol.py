"""Anthropic Messages wire models (requests). Unknown fields are allowed and ignored unless they change
the result; those are listed in ``UNSUPPORTED`` and rejected with a 400 that names them.

Content may be a string or a list of blocks; a string is read as one text block. A block of a type
this gateway cannot render (``image``, ``document``, ``redacted_thinking``…) validates as
``OtherBlock``, so that serving can reject it with a 400 naming the block and its index.

Messages and blocks follow the Messages API's schemas (``check_messages``, run before the model
validates): a block that lacks a field its type requires, carries a field only another block type has,
or sits in a message whose role cannot hold it (``tool_use`` and thinking in an assistant message,
``tool_result`` in a user message) gets the 400 Anthropic gives, in its wording
(``messages.0.content.0.tool_use.id: Field required``). ``cache_control`` is accepted on every block.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from core.errors import InvalidRequest


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


def _as_blocks(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class TextBlock(_Wire):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Wire):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ToolUseBlock(_Wire):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class OtherBlock(_Wire):
    """Any block type not listed above; serving rejects it with a 400."""

    type: str


def _block_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "thinking", "tool_use", "tool_result") else "other"


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(lambda v: "text" if _block_type(v) == "text" else "other"),
]


class ToolResultBlock(_Wire):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[list[ResultBlock], BeforeValidator(_as_blocks)] = Field(default_factory=list)
    is_error: bool | None = False


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_type),
]


class Message(_Wire):
    # "system": a mid-conversation system message (Claude Code's beta mid-conversation-system-2026-04-07)
    role: Literal["user", "assistant", "system"]
    content: Annotated[list[Block], BeforeValidator(_as_blocks)]


class ToolDef(_Wire):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required for client tools; server tools have none
    type: str | None = None  # None or "custom" for client tools; anything else is a server tool


class ToolChoice(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Wire):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _per_role(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_messages(data.get("messages"))
        return data


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None


# Fields that would change the result and that Belayer does not implement: reject rather than ignore.
UNSUPPORTED: dict[str, str] = {
    "mcp_servers": "'mcp_servers' (server-side MCP tools) is not supported; run the tools in the client",
    "container": "'container' (server-side code execution) is not supported; remove it",
    "output_format": "'output_format' (structured output) is not supported; describe the format in the prompt",
}


# --- per-role message schemas ------------------------------------------------------------------------
# Each block type's fields, as the Messages API defines them (the anthropic SDK's *BlockParam, beta
# fields included), and the ones it requires.
BLOCK_FIELDS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "image": frozenset({"type", "source", "cache_control", "transformations"}),
    "document": frozenset({"type", "source", "cache_control", "citations", "context", "title"}),
    "search_result": frozenset({"type", "content", "source", "title", "cache_control", "citations"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}),
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "image": ("source",),
    "document": ("source",),
    "search_result": ("content", "source", "title"),
    "thinking": ("thinking", "signature"),
    "redacted_thinking": ("data",),
    "tool_use": ("id", "name", "input"),
    "tool_result": ("tool_use_id",),
}
_STRINGS = {"text", "thinking", "signature", "data", "id", "name", "tool_use_id", "title"}
_ALL_FIELDS = frozenset().union(*BLOCK_FIELDS.values())
# cache_control is let through on every block (Anthropic refuses it on thinking blocks, but harnesses
# put it on whatever block is last); a field no block type has is left to serving, which ignores it.
_LENIENT = frozenset({"cache_control"})
ONLY_IN: dict[str, str] = {
    "tool_use": "assistant",
    "thinking": "assistant",
    "redacted_thinking": "assistant",
    "tool_result": "user",
}
# Fields of OpenAI's chat messages: a message that carries one was written for the other protocol.
OPENAI_FIELDS = ("tool_calls", "tool_call_id", "function_call")


def check_messages(messages: Any) -> None:
    """Each message and block against the Messages API's schema, with its 400 for the first fault:

    >>> check_messages([{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}])
    Traceback (most recent call last):
    ...
    core.errors.InvalidRequest: messages.0.content.0.tool_use.id: Field required

    What is not a list of objects with a known role is left to the model's own validation."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") in ("user", "assistant", "system"):
            _check_message(message, message["role"], f"messages.{i}")


def _error(path: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(f"{path}: {message}", path, code)


def _check_message(message: dict[str, Any], role: str, where: str) -> None:
    if "content" not in message:
        raise _error(f"{where}.content", "Field required", "missing_required_parameter")
    for key in OPENAI_FIELDS:
        if message.get(key) is not None:
            raise _error(f"{where}.{key}", "Extra inputs are not permitted", "unknown_parameter")
    content = message["content"]
    if not isinstance(content, list):
        return  # a string, or a type error the model reports
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in BLOCK_FIELDS:  # (a type may be any JSON: unhashable)
            if ONLY_IN.get(kind, role) != role:
                raise InvalidRequest(
                    f"{where}: `{kind}` blocks can only be in `{ONLY_IN[kind]}` messages",
                    f"{where}.content.{j}",
                    "invalid_value",
                )
            _check_block(block, kind, f"{where}.content.{j}.{kind}")


def _check_block(block: dict[str, Any], kind: str, where: str) -> None:
    for key in REQUIRED[kind]:
        if key not in block:
            raise _error(f"{where}.{key}", "Field required", "missing_required_parameter")
    for key in block:
        if key in _ALL_FIELDS - BLOCK_FIELDS[kind] - _LENIENT:
            raise _error(f"{where}.{key}", "Extra inputs are not permitted", "unknown_parameter")
    for key in REQUIRED[kind]:
        if key in _STRINGS and not isinstance(block[key], str):
            raise _error(f"{where}.{key}", "Input should be a valid string", "invalid_type")
    if kind == "tool_use" and not isinstance(block["input"], dict):
        raise _error(f"{where}.input", "Input should be a valid dictionary", "invalid_type")
    if kind == "tool_result":
        if not isinstance(block.get("is_error", False), bool | None):
            raise _error(f"{where}.is_error", "Input should be a valid boolean", "invalid_type")
        nested = block.get("content")
        for k, item in enumerate(nested if isinstance(nested, list) else []):
            if isinstance(item, dict) and item.get("type") in ("text", "image", "document", "search_result"):
                _check_block(item, item["type"], f"{where}.content.{k}.{item['type']}")
