"""OpenAI Responses wire models (requests). Unknown fields are allowed and ignored unless they change the
result; those are listed in ``UNSUPPORTED`` and rejected with a 400 that names them.

``input`` is a string (one user message) or a list of items; content is a string (one text part) or a
list of parts. An item of a type this gateway cannot
render (``item_reference``, ``web_search_call``, ``computer_call_output``, …), a content part that is
not text, a tool that is not a function, validate as ``Other*`` models, so that serving can reject them
with a 400 naming the item and its index.

Items follow OpenAI's per-type and per-role schemas (``check_input``, run before the model validates):
an item that carries a field only another item type has, a message without its role or content, or a
message part its role cannot send (``input_text`` in an assistant message, ``output_text`` in a user's)
gets the 400 OpenAI gives, in its wording, ``param`` and ``code``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

from core.errors import InvalidRequest
from gateway.api.openai.protocol import one_of


class _Wire(BaseModel):
    model_config = ConfigDict(extra="allow")


def _as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _as_items(value: Any) -> Any:
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


class ContentPart(_Wire):
    """``input_text``/``output_text`` (and ``text``) parts carry text; serving rejects other types."""

    type: str
    text: str | None = None


class MessageItem(_Wire):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[list[ContentPart], BeforeValidator(_as_parts)]


class FunctionCallItem(_Wire):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Wire):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[list[ContentPart], BeforeValidator(_as_parts)]


class ReasoningText(_Wire):
    type: str
    text: str


class ReasoningItem(_Wire):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class OtherItem(_Wire):
    """Any item type not listed above; serving rejects it with a 400."""

    type: str


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        kind = value.get("type", "message" if "role" in value else None)
    else:
        kind = getattr(value, "type", None)
    return kind if kind in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_type),
]


class FunctionTool(_Wire):
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OtherTool(_Wire):
    """A hosted or custom tool (``web_search``, ``custom``, ``mcp``…); serving rejects it with a 400."""

    type: str


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(
        lambda v: "function" if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) == "function"
        else "other"
    ),
]  # fmt: skip


class FunctionChoice(_Wire):
    type: Literal["function"]
    name: str


class OtherChoice(_Wire):
    """``allowed_tools`` or a hosted tool type; serving rejects it with a 400."""

    type: str


ToolChoice = Annotated[
    Annotated[FunctionChoice, Tag("function")] | Annotated[OtherChoice, Tag("other")],
    Discriminator(
        lambda v: "function" if (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) == "function"
        else "other"
    ),
]  # fmt: skip


class TextFormat(_Wire):
    type: str


class TextConfig(_Wire):
    format: TextFormat | None = None


class ResponsesRequest(_Wire):
    model: str
    input: Annotated[list[InputItem], BeforeValidator(_as_items)]
    """A string is read as one user message."""
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoice | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    store: bool | None = True
    stream: bool | None = False
    text: TextConfig | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _per_role(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_input(data.get("input"))
        return data


# Fields that would change the result and that Belayer does not implement: reject rather than ignore.
UNSUPPORTED: dict[str, str] = {
    "background": "background responses are not supported; send the request without 'background' and wait",
    "conversation": "'conversation' (stored conversations) is not supported; chain with "
    "'previous_response_id' or send the whole input",
    "prompt": "stored prompt templates ('prompt') are not supported; send 'instructions' and 'input'",
    "context_management": "'context_management' (server-side compaction) is not supported; remove it",
}


# --- per-role item schemas ---------------------------------------------------------------------------
# Each input item type's fields (the openai SDK's ResponseInputItemParam members). A field of another
# item type is refused as OpenAI refuses an unknown one; ``name`` on any item (chat-style clients send
# it) and a field no item type has are let through, and a null field counts as absent.
ITEM_FIELDS: dict[str, frozenset[str]] = {
    "message": frozenset({"type", "role", "content", "id", "status", "phase", "name"}),
    "function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status", "namespace"}),
    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"}),
    "reasoning": frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}),
}
_ITEM_ONLY = frozenset().union(*ITEM_FIELDS.values())
INPUT_PARTS = ("input_text", "input_image", "input_file")
OUTPUT_PARTS = ("output_text", "refusal")
"""What a user, system or developer message sends, and what an assistant's does (``text`` passes in
either: this gateway's own leniency; other types are serving's 400 for a text-only model)."""


def check_input(items: Any) -> None:
    """Each input item against its type's and its role's schema, with OpenAI's 400 for the first fault:

    >>> check_input([{"role": "assistant", "content": [{"type": "input_text", "text": "hi"}]}])
    Traceback (most recent call last):
    ...
    core.errors.InvalidRequest: Invalid value: 'input_text'. Supported values are: 'output_text' and 'refusal'.
    """
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        kind = _item_type(item)
        if kind != "other":
            _check_item(item, kind, f"input[{i}]")


def _check_item(item: dict[str, Any], kind: str, where: str) -> None:
    for key in sorted(_ITEM_ONLY - ITEM_FIELDS[kind] - {"name"}):
        if item.get(key) is not None:
            raise InvalidRequest(
                f"Unknown parameter: '{where}.{key}'.", f"{where}.{key}", "unknown_parameter"
            )
    if kind != "message":
        return
    for key in ("role", "content"):
        if key not in item:
            raise InvalidRequest(
                f"Missing required parameter: '{where}.{key}'.",
                f"{where}.{key}",
                "missing_required_parameter",
            )
    content = item["content"]
    if item["role"] not in ("user", "system", "developer", "assistant") or not isinstance(content, list):
        return  # the model's 400
    allowed, refused = (
        (OUTPUT_PARTS, INPUT_PARTS) if item["role"] == "assistant" else (INPUT_PARTS, OUTPUT_PARTS)
    )
    for j, part in enumerate(content):
        part_type = part.get("type") if isinstance(part, dict) else None
        if isinstance(part_type, str) and part_type in refused:
            raise InvalidRequest(
                f"Invalid value: '{part_type}'. Supported values are: {one_of(allowed)}.",
                f"{where}.content[{j}]",
                "invalid_value",
            )
