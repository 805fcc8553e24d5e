"""OpenAI wire models (requests). Unknown fields are allowed and ignored unless they change the result;
those are listed in ``UNSUPPORTED`` and rejected with a 400 that names them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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
