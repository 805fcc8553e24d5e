"""Anthropic Messages requests → ``GenerationRequest``, and ``Delta``/``Done`` events → Anthropic JSON and SSE.

Both protocols share one internal representation: the messages that
``gateway.api.openai.serving.normalize_messages`` produces (role, text content, tool calls with parsed
arguments, ``tool`` messages). So they share the chat template, prefix reuse and failover. The mapping:

- ``system``: its text blocks concatenated as sent (as vLLM does), except Claude Code's
  ``x-anthropic-billing-header`` block, whose per-request hash would change the prompt every turn and
  so defeat prefix reuse.
- A user message's text blocks are joined with ``"\\n"`` (as vLLM joins text parts); each
  ``tool_result`` becomes a ``tool`` message, in order, and ``is_error`` shows as an ``Error: `` prefix.
- An assistant message's ``text`` and ``thinking`` blocks are concatenated with nothing in between,
  thinking as ``<think>…</think>`` (the Qwen/Hermes family's tags; the tiny template has no thinking
  field). This is the exact inverse of how a response's text is split into blocks, so a harness that
  sends a response back unchanged matches the turn that produced it and prefix reuse applies. (Without
  ``--reasoning-parser``, generated ``<think>`` text stays in the text block; with one, it is a thinking
  block, and the turn is matched in the ``<think>{thinking}</think>{text}`` form, see
  ``gateway.policy.parsers.think``.) ``tool_use`` blocks become tool calls.
- A ``system`` message inside ``messages`` (Claude Code sends them, beta
  ``mid-conversation-system-2026-04-07``) stays a ``system`` message in place, its text blocks joined
  with ``"\n"``; the chat template decides how it renders (a template that allows a system message
  only first rejects it with a 400).
- Blocks the model cannot read (``image``, ``document``, ``redacted_thinking``, …) are a 400 naming the
  block and its index, never dropped. So is a final assistant message (prefill).
- The request's ``thinking`` setting is ignored: whether the policy thinks is up to the policy.
- ``stop_reason``: ``tool_use`` when the turn made tool calls, ``stop_sequence`` when a stop sequence cut
  it (``StopTrimmer.matched``), ``max_tokens`` on the token limit, else ``end_turn``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequest
from core.fastjson import dumps_str
from engine_pool.engine.client import SamplingParams
from gateway.api.anthropic.protocol import (
    UNSUPPORTED,
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from gateway.http.errors import anthropic_error, for_exception
from gateway.policy.streaming import ToolCall, tool_choice_prefix
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.protocol import Delta, Done, GenerationRequest, parse_arguments
from gateway.turns.sessions import SessionManager
from store import SessionRecord

BILLING_HEADER = "x-anthropic-billing-header"
THINKING_SIGNATURE = "belayer"  # a thinking block's signature: clients keep it and send it back; unchecked
TOOL_ERROR_PREFIX = "Error: "
ALLOWED = {
    "a user message": "text and tool_result",
    "an assistant message": "text, thinking and tool_use",
    "a tool_result": "text",
    "a system message": "text",
}
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def reject_unsupported(body: dict[str, Any]) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}):
            raise InvalidRequest(why, param=key, code="unsupported_parameter")
    config = body.get("output_config")
    if isinstance(config, dict) and config.get("format") is not None:
        raise InvalidRequest(UNSUPPORTED["output_format"], "output_config.format", "unsupported_parameter")


def _unsupported(kind: str, where: str, container: str) -> InvalidRequest:
    hint = (
        "this gateway serves a text-only model; send the content as text"
        if kind in ("image", "document")
        else f"{container} may hold {ALLOWED[container]} blocks"
    )
    return InvalidRequest(
        f"content block {where} of type '{kind}' is not supported in {container}; {hint}",
        param=where,
        code="unsupported_content",
    )


def _system(blocks: list[TextBlock] | None) -> str:
    return "".join(b.text for b in blocks or [] if not b.text.startswith(BILLING_HEADER))


def _joined_text(blocks: Sequence[Any], where: str, context: str) -> str:
    """The text of blocks that may only be text, joined with newlines; anything else is a clear 400."""
    for k, part in enumerate(blocks):
        if not isinstance(part, TextBlock):
            raise _unsupported(part.type, f"{where}.content[{k}]", context)
    return "\n".join(part.text for part in blocks)


def _tool_result(block: ToolResultBlock, where: str) -> dict[str, Any]:
    text = _joined_text(block.content, where, "a tool_result")
    if block.is_error:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "content": text, "tool_call_id": block.tool_use_id}


def _user(message: Message, where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, f"{where}.content[{j}]"))
        else:
            raise _unsupported(block.type, f"{where}.content[{j}]", "a user message")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _mid_system(message: Message, where: str) -> dict[str, Any]:
    return {"role": "system", "content": _joined_text(message.content, where, "a system message")}


def _assistant(message: Message, where: str) -> dict[str, Any]:
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            text.append(f"<think>{block.thinking}</think>")
        elif isinstance(block, ToolUseBlock):
            fn = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": fn})
        else:
            raise _unsupported(block.type, f"{where}.content[{j}]", "an assistant message")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def normalize_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The request's system prompt and messages in the internal (template-ready) form."""
    if req.messages[-1].role == "assistant":
        raise InvalidRequest(
            "the last message must be a user message; assistant prefill is not supported",
            param=f"messages[{len(req.messages) - 1}].role",
        )
    system = _system(req.system)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        if m.role == "assistant":
            out.append(_assistant(m, where))
        elif m.role == "system":
            out.append(_mid_system(m, where))
        else:
            out += _user(m, where)
    return out


def _tools(req: CountTokensRequest) -> list[dict[str, Any]] | None:
    """Tools in the template's form: ``{"type": "function", "function": {name, description, parameters}}``."""
    out = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"tools[{i}] is a server tool of type '{tool.type}', which this gateway does not run; "
                "send client tools (name, description, input_schema)",
                param=f"tools[{i}].type",
                code="unsupported_tool",
            )
        if tool.input_schema is None:
            raise InvalidRequest(f"tools[{i}] needs an 'input_schema'", param=f"tools[{i}].input_schema")
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        fn["parameters"] = tool.input_schema
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(req: CountTokensRequest, tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    names = [t["function"]["name"] for t in tools or []]
    choice = req.tool_choice
    if choice is None:
        return tool_choice_prefix(names, None)
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice of type 'tool' needs a 'name'", "tool_choice.name")
        return tool_choice_prefix(names, None, choice.name)
    return tool_choice_prefix(names, _CHOICES[choice.type])


@dataclass(slots=True)
class Prompt:
    """What a Messages request renders to, before prefix reuse."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    forced_prefix: str
    parse_tools: bool


def prompt_of(req: CountTokensRequest) -> Prompt:
    messages = normalize_messages(req)
    tools = _tools(req)
    forced, parse_tools = _tool_choice(req, tools)
    return Prompt(messages, tools, forced, parse_tools)


def _sampling(req: MessagesRequest) -> SamplingParams:
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or None,  # Anthropic's 0 means no top-k
        stop=tuple(req.stop_sequences or ()),
    )


def message_request(
    req: MessagesRequest,
    raw: dict[str, Any],
    session: SessionRecord | str,
    sessions: SessionManager,
) -> GenerationRequest:
    """The internal request for a Messages call (`session`: as admitted, its id when the planning reads
    it)."""
    received = time.time()
    p = prompt_of(req)
    plan, keys, session = sessions.plan(session, p.messages, p.tools)
    return GenerationRequest(
        session=session,
        plan=plan,
        params=_sampling(req),
        request=raw,
        received_at=received,
        max_tokens=req.max_tokens,
        messages=p.messages,
        tools=p.tools,
        message_keys=keys,
        forced_prefix=p.forced_prefix,
        parse_tools=p.parse_tools,
        stream=bool(req.stream),
    )


def prompt_tokens(prompt_ids: list[int], forced_prefix: str, tok: ChatTokenizer) -> int:
    """The prompt length the engine gets (what ``TurnRunner.prepare`` builds)."""
    return len(prompt_ids) + (len(tok.encode(forced_prefix)) if forced_prefix else 0)


def count_tokens(
    req: CountTokensRequest, session: SessionRecord | None, sessions: SessionManager, tok: ChatTokenizer
) -> int:
    """``input_tokens`` of a request with these messages, with prefix reuse in a session (open or not);
    records nothing."""
    p = prompt_of(req)
    if session is None:
        ids = tok.encode(tok.render(p.messages, p.tools, add_generation_prompt=True))
    else:
        ids = sessions.plan(session, p.messages, p.tools)[0].prompt_ids
    return prompt_tokens(ids, p.forced_prefix, tok)


def stop_reason(done: Done) -> str:
    if done.finish_reason == "tool_calls":
        return "tool_use"
    if done.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if done.finish_reason == "length" else "end_turn"


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {dumps_str(data)}\n\n"


Event = tuple[str, dict[str, Any]]


class MessageFormatter:
    """Formats one message's events as Anthropic content blocks: a message, or the SSE event sequence.

    Text goes into the open text block; each tool call is a ``tool_use`` block of its own (start,
    one ``input_json_delta``, stop). Streamed and non-streamed responses build ``blocks`` the same way.
    """

    def __init__(self, model: str, input_tokens: int) -> None:
        self.id = f"msg_{secrets.token_hex(12)}"
        self.model = model
        self.input_tokens = input_tokens
        self.blocks: list[dict[str, Any]] = []
        self._text_open = False
        self._thinking_open = False

    def _message(self, content: list[dict[str, Any]], done: Done | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(done) if done else None,
            "stop_sequence": done.stop_sequence if done else None,
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": done.completion_tokens if done else 0,
            },
        }

    def start(self) -> list[Event]:
        return [
            ("message_start", {"type": "message_start", "message": self._message([], None)}),
            ("ping", {"type": "ping"}),
        ]

    def _close(self) -> list[Event]:
        events = []
        if self._thinking_open:  # a thinking block ends with its signature, as Anthropic's do
            events.append(self._delta({"type": "signature_delta", "signature": THINKING_SIGNATURE}))
        elif not self._text_open:
            return []
        self._text_open = self._thinking_open = False
        events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
        return events

    def _thinking(self, text: str) -> list[Event]:
        """Reasoning (``--reasoning-parser``) goes into a thinking block, before the text it precedes."""
        delta = {"type": "thinking_delta", "thinking": text}
        if self._thinking_open:
            self.blocks[-1]["thinking"] += text
            return [self._delta(delta)]
        events = self._close()
        complete = {"type": "thinking", "thinking": text, "signature": THINKING_SIGNATURE}
        events += self._open({"type": "thinking", "thinking": "", "signature": ""}, complete, delta)
        self._thinking_open = True
        return events

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": len(self.blocks) - 1,
            "delta": delta,
        }

    def _open(self, block: dict[str, Any], complete: dict[str, Any], delta: dict[str, Any]) -> list[Event]:
        """Start ``block`` (as it looks empty), send its first delta, and keep it as ``complete``."""
        start = {"type": "content_block_start", "index": len(self.blocks), "content_block": block}
        self.blocks.append(complete)
        return [("content_block_start", start), self._delta(delta)]

    def feed(self, delta: Delta) -> list[Event]:
        """The stream events for one ``Delta``; also grows ``blocks``."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._thinking(delta.reasoning)
        if delta.content:
            text = {"type": "text_delta", "text": delta.content}
            if self._text_open:
                self.blocks[-1]["text"] += delta.content
                events.append(self._delta(text))
            else:
                events += self._close()
                events += self._open(
                    {"type": "text", "text": ""}, {"type": "text", "text": delta.content}, text
                )
                self._text_open = True
        for call in delta.tool_calls:
            events += self._close()
            events += self._tool_use(call)
        return events

    def _tool_use(self, call: ToolCall) -> list[Event]:
        args = parse_arguments(call.arguments)
        block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}}
        partial = {"type": "input_json_delta", "partial_json": json.dumps(args, ensure_ascii=False)}
        events = self._open(block, {**block, "input": args}, partial)
        events.append(("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1}))
        return events

    def finish(self, done: Done) -> list[Event]:
        message = self._message(self.blocks, done)
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        return [
            *self._close(),
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": message["usage"]}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def stream_error(self, exc: Exception) -> str:
        """An error after the headers went out: Anthropic's ``event: error``."""
        status, err = for_exception(exc)
        return sse("error", anthropic_error(status, err))

    def response(self, done: Done) -> dict[str, Any]:
        return self._message(self.blocks, done)

    async def stream(self, events: AsyncIterator[Delta | Done]) -> AsyncIterator[str]:
        for name, data in self.start():
            yield sse(name, data)
        async for ev in events:
            out = self.finish(ev) if isinstance(ev, Done) else self.feed(ev)
            for name, data in out:
                yield sse(name, data)


def tool_use_id(call_id: str) -> str:
    """Anthropic-style id for a parsed call (``call_x`` → ``toolu_x``)."""
    return "toolu_" + call_id.removeprefix("call_")
