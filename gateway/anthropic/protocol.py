"""Anthropic Messages wire models (requests). Unknown fields are allowed and ignored unless they change
the result; those are listed in ``UNSUPPORTED`` and rejected with a 400 that names them.

Content may be a string or a list of blocks; a string is read as one text block. A block of a type
this gateway cannot render (``image``, ``document``, ``redacted_thinking``…) validates as
``OtherBlock``, so that serving can reject it with a 400 naming the block and its index.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag


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
