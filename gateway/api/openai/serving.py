"""OpenAI requests → ``GenerationRequest``, and ``Delta``/``Done`` events → OpenAI JSON and SSE."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from core.errors import InvalidRequest
from core.fastjson import sse_data
from engine_pool.engine.client import SamplingParams
from gateway.api.openai.protocol import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    NamedToolChoice,
)
from gateway.http.errors import for_exception
from gateway.policy.parsers import think_text
from gateway.policy.streaming import ToolCall, tool_choice_prefix
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.prefix import PromptPlan
from gateway.turns.protocol import Delta, Done, GenerationRequest, parse_arguments
from gateway.turns.sessions import SessionManager
from store import SessionRecord


def reject_unsupported(body: dict[str, Any]) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}):
            raise InvalidRequest(why, param=key, code="unsupported_parameter")
    if (body.get("n") or 1) != 1:
        raise InvalidRequest(
            "only n=1 is supported; send n separate requests instead", "n", "unsupported_parameter"
        )


def _text(content: str | list[Any] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise InvalidRequest(
                f"content part of type '{part.type}' is not supported by this text-only model; send text parts",
                param=f"{where}.content[{i}]",
                code="unsupported_content",
            )
        if part.text is None:
            raise InvalidRequest(
                "a content part of type 'text' needs its 'text'",
                f"{where}.content[{i}].text",
                "missing_required_parameter",
            )
        parts.append(part.text)
    return "".join(parts)


def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages in the form the chat template renders (roles, text content, parsed tool arguments)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _text(m.content, f"messages[{i}]")}
        reasoning = m.reasoning_content or m.reasoning
        if (
            m.role == "assistant" and reasoning
        ):  # rendered as generated (see ``gateway.policy.parsers.think``)
            msg["content"] = think_text(reasoning, msg["content"])
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": parse_arguments(tc.function.arguments),
                    },
                }
                for tc in m.tool_calls
            ]
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _tool_choice(req: ChatCompletionRequest) -> tuple[str, bool]:
    """(forced assistant prefix, whether to parse tool calls) for the request's tool_choice."""
    names = [t.function.name for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return tool_choice_prefix(names, None, choice.function.name)
    return tool_choice_prefix(names, choice)


def _logprob_count(logprobs: bool | None, top: int | None) -> int | None:
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs needs logprobs=true", "top_logprobs")
    return (top or 0) if logprobs else None


def sampling(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: str | list[str] | None,
    top_logprobs: int | None,
    presence: float | None,
    frequency: float | None,
) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k,
        seed=seed,
        stop=stops,
        top_logprobs=top_logprobs or 0,
        presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0,
    )


def chat_request(
    req: ChatCompletionRequest, raw: dict[str, Any], session: SessionRecord | str, sessions: SessionManager
) -> tuple[GenerationRequest, int | None]:
    """The internal request for a chat completion, and how many top logprobs the client asked for
    (`session`: as admitted, its id when the planning reads it)."""
    received = time.time()
    forced, parse_tools = _tool_choice(req)
    top = _logprob_count(req.logprobs, req.top_logprobs)
    messages = normalize_messages(req.messages)
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    params = sampling(
        req.temperature,
        req.top_p,
        req.top_k,
        req.seed,
        req.stop,
        top,
        req.presence_penalty,
        req.frequency_penalty,
    )
    plan, keys, session = sessions.plan(session, messages, tools)
    gen = GenerationRequest(
        session=session,
        plan=plan,
        params=params,
        request=raw,
        received_at=received,
        max_tokens=req.max_completion_tokens or req.max_tokens,
        messages=messages,
        tools=tools,
        message_keys=keys,
        forced_prefix=forced,
        parse_tools=parse_tools,
    )
    return gen, top


def completion_request(
    req: CompletionRequest, raw: dict[str, Any], session: SessionRecord | str, sessions: SessionManager,
    tok: ChatTokenizer,
) -> GenerationRequest:  # fmt: skip
    if isinstance(session, str):  # no prefix to reuse: the session alone, before the prompt is read
        session = sessions.get_open(session)
    if req.echo:
        raise InvalidRequest("'echo' is not supported; remove it", "echo", "unsupported_parameter")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise InvalidRequest("send one prompt per request (batched prompts are not supported)", "prompt")
        prompt = prompt[0]
    ids = tok.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise InvalidRequest("the prompt is empty; send text or token ids", "prompt")
    params = sampling(
        req.temperature, req.top_p, req.top_k, req.seed, req.stop, req.logprobs, req.presence_penalty,
        req.frequency_penalty,
    )  # fmt: skip
    plan = PromptPlan(ids, [], None, 0, "raw completion prompt")
    return GenerationRequest(
        session, plan, params, raw, time.time(), max_tokens=req.max_tokens, parse_tools=False
    )


class _OpenAIFormatter:
    """What both OpenAI formatters share: top logprobs gathered from non-streamed deltas, and the
    in-stream error event."""

    ID_PREFIX: str

    def __init__(
        self, model: str, tok: ChatTokenizer, top_logprobs: int | None, include_usage: bool = False
    ) -> None:
        self.include_usage = include_usage
        self.tops: list[list[tuple[int, float]]] = []
        self.id = f"{self.ID_PREFIX}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.model = model
        self.tok = tok
        self.top = top_logprobs

    def feed(self, delta: Delta) -> None:
        self.tops += delta.top_logprobs

    def stream_error(self, exc: Exception) -> str:
        _, err = for_exception(exc)
        return f"data: {json.dumps(err)}\n\n"


class ChatFormatter(_OpenAIFormatter):
    """Formats one chat completion's events as OpenAI objects."""

    ID_PREFIX = "chatcmpl"

    def _logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> dict[str, Any]:
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            alts = sorted(tops[i], key=lambda a: -a[1])[: self.top] if i < len(tops) and self.top else []
            content.append(
                {
                    **self._token(tid),
                    "logprob": lp,
                    "top_logprobs": [{**self._token(a), "logprob": v} for a, v in alts],
                }
            )
        return {"content": content}

    def _token(self, tid: int) -> dict[str, Any]:
        raw = self.tok.token_bytes(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}

    @staticmethod
    def _calls(calls: list[ToolCall], stream: bool) -> list[dict[str, Any]]:
        return [
            {
                **({"index": c.index} if stream else {}),
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]

    @staticmethod
    def usage(done: Done) -> dict[str, int]:
        return {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
        }

    def response(self, done: Done) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": done.content or None}
        if done.reasoning:  # vLLM's older name, which most clients read, and its newer one
            message["reasoning_content"] = message["reasoning"] = done.reasoning
        if done.tool_calls:
            message["tool_calls"] = self._calls(done.tool_calls, stream=False)
        turn = done.turn
        logprobs = None
        if self.top is not None:
            logprobs = self._logprobs(turn.output_ids, turn.output_logprobs, self.tops)
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": done.finish_reason}
            ],
            "usage": self.usage(done),
        }

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        return sse_data(body)

    async def stream(self, events: AsyncIterator[Delta | Done]) -> AsyncIterator[str]:
        yield self._chunk({"role": "assistant", "content": ""})
        async for ev in events:
            if isinstance(ev, Done):
                yield self._chunk({}, ev.finish_reason)
                if self.include_usage:
                    body = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model, "choices": [], "usage": self.usage(ev)}  # fmt: skip
                    yield sse_data(body)
                continue
            delta: dict[str, Any] = {}
            if ev.reasoning:
                delta["reasoning_content"] = delta["reasoning"] = ev.reasoning
            if ev.content:
                delta["content"] = ev.content
            if ev.tool_calls:
                delta["tool_calls"] = self._calls(ev.tool_calls, stream=True)
            lp = self._logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs) if self.top is not None else None
            if delta or (lp and lp["content"]):
                yield self._chunk(delta, None, lp)
        yield "data: [DONE]\n\n"


class CompletionFormatter(_OpenAIFormatter):
    """Formats one text completion's events as OpenAI ``text_completion`` objects."""

    ID_PREFIX = "cmpl"

    def _logprobs(
        self, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]]
    ) -> dict[str, Any]:
        tokens = [self.tok.token_text(t) for t in ids]
        top = [
            {self.tok.token_text(a): v for a, v in sorted(alts, key=lambda a: -a[1])[: self.top]}
            for alts in tops[: len(ids)]
        ]
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top or None}

    def _body(self, text: str, finish: str | None, logprobs: Any, usage: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def response(self, done: Done) -> dict[str, Any]:
        t = done.turn
        lp = self._logprobs(t.output_ids, t.output_logprobs, self.tops) if self.top is not None else None
        return self._body(done.content, done.finish_reason, lp, ChatFormatter.usage(done))

    async def stream(self, events: AsyncIterator[Delta | Done]) -> AsyncIterator[str]:
        async for ev in events:
            if isinstance(ev, Done):
                body = self._body(
                    "", ev.finish_reason, None, ChatFormatter.usage(ev) if self.include_usage else None
                )
            else:
                lp = (
                    self._logprobs(ev.token_ids, ev.logprobs, ev.top_logprobs)
                    if self.top is not None
                    else None
                )
                if not ev.content and not lp:
                    continue
                body = self._body(ev.content, None, lp)
            yield sse_data(body)
        yield "data: [DONE]\n\n"
