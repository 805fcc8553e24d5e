"""``Delta``/``Done`` events → an OpenAI Responses object, or the SSE event sequence of a streamed one; a
stored turn → its Responses object (``GET /v1/responses/{id}``).

Output items follow the generated text: text goes into the open ``message`` item; each tool call closes
it and is a ``function_call`` item of its own (added, one arguments delta, arguments done, done); text
after a call opens a new message item. Reasoning that a ``--reasoning-parser`` split off comes first, as
a ``reasoning`` item (added, ``response.reasoning_text.delta`` …, ``response.reasoning_text.done``,
done). Streamed and non-streamed responses build ``items`` the same way. A stream is::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
    response.output_text.delta …, response.output_text.done, response.content_part.done,
    response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done, …
    response.completed (or response.incomplete when max_output_tokens cut it)

each event with its ``sequence_number`` (0, 1, …). An error after the headers went out is an ``error``
event followed by ``response.failed``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from core.fastjson import dumps_str
from gateway.api.openai.responses import response_id
from gateway.http.errors import for_exception
from gateway.policy.streaming import ToolCall
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.protocol import Delta, Done, GenerationRequest
from store import TurnRecord
from store.base import TURN_ABORTED, TURN_RUNNING

Event = dict[str, Any]


# --- Responses objects ------------------------------------------------------------------------------


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def reused_tokens(turn: TurnRecord) -> int:
    """The prompt tokens reused from the turn's parent: its span ends where the parent's output ends."""
    if turn.parent_id is None:
        return 0
    return next((end for _, end, tid in turn.prompt_gen_spans if tid == turn.parent_id), 0)


def item_ids(turn: TurnRecord) -> str:
    """The part of the response id that item ids repeat."""
    return response_id(turn).removeprefix("resp_")


def message_item(item_id: str, text: str, status: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "reasoning_text", "text": text}
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": [part]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": "fc_" + call_id.removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def response_body(
    rid: str,
    raw: dict[str, Any],
    created_at: float,
    status: str,
    output: list[dict[str, Any]],
    use: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
    completed_at: float | None = None,
) -> dict[str, Any]:
    """A Responses ``response`` object; the request's settings echo `raw` (as sent)."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created_at),
        "completed_at": int(completed_at) if completed_at is not None else None,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete,
        "instructions": raw.get("instructions"),
        "max_output_tokens": raw.get("max_output_tokens"),
        "model": raw.get("model"),
        "output": output,
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "previous_response_id": raw.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": raw.get("store", True) is not False,
        "temperature": raw.get("temperature", 1.0),
        "text": raw.get("text") or {"format": {"type": "text"}},
        "tool_choice": raw.get("tool_choice") or "auto",
        "tools": raw.get("tools") or [],
        "top_logprobs": raw.get("top_logprobs") or 0,
        "top_p": raw.get("top_p", 1.0),
        "truncation": raw.get("truncation") or "disabled",
        "usage": use,
        "user": raw.get("user"),
        "metadata": raw.get("metadata") or {},
    }


def stored_response(turn: TurnRecord) -> dict[str, Any]:
    """The response object of a stored turn (``GET /v1/responses/{id}``)."""
    rid = response_id(turn)
    core = item_ids(turn)
    if turn.status == TURN_RUNNING:
        return response_body(rid, turn.request, turn.received_at, "in_progress", [], None)
    use = usage(len(turn.prompt_ids), len(turn.output_ids), reused_tokens(turn))
    if turn.response is None:
        status = "cancelled" if turn.status == TURN_ABORTED else "failed"
        error = {"code": "server_error", "message": turn.error or f"the turn is {turn.status}"}
        return response_body(rid, turn.request, turn.received_at, status, [], use, error)
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    message = turn.response["message"]
    output = [message_item(f"msg_{core}", message["content"], status)] if message.get("content") else []
    if message.get("reasoning_content"):
        output.insert(0, reasoning_item(f"rs_{core}", message["reasoning_content"], status))
    output += [
        call_item(c["id"], c["function"]["name"], c["function"]["arguments"], status)
        for c in message.get("tool_calls") or []
    ]
    return response_body(rid, turn.request, turn.received_at, status, output, use, None, finished_at(turn))


def finished_at(turn: TurnRecord) -> float:
    """When the turn finished (its start plus its total time)."""
    return turn.received_at + turn.timings.get("total_ms", 0.0) / 1000


# --- one turn's events ------------------------------------------------------------------------------


def sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {dumps_str(event)}\n\n"


class ResponseFormatter:
    """Formats one turn's events as a Responses object, or as its stream of events."""

    def __init__(
        self, gen: GenerationRequest, raw: dict[str, Any], tok: ChatTokenizer, top_logprobs: int | None
    ) -> None:
        self.gen = gen
        self.raw = raw
        self.tok = tok
        self.top = top_logprobs
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # index of the message item text goes to
        self._thinking: int | None = None  # index of the open reasoning item (``--reasoning-parser``)
        self._messages = 0
        self._seq = 0
        self._pending: list[dict[str, Any]] = []  # logprobs of tokens not shown as text yet

    @property
    def turn(self) -> TurnRecord:
        turn = self.gen.turn
        assert turn is not None, "the turn runner stores the turn before its first event"
        return turn

    @property
    def id(self) -> str:
        return response_id(self.turn)

    def _event(self, kind: str, **data: Any) -> Event:
        event = {"type": kind, **data, "sequence_number": self._seq}
        self._seq += 1
        return event

    def _body(self, status: str, done: Done | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        turn = self.turn
        use = None
        if done is not None or error is not None:
            use = usage(len(turn.prompt_ids), len(turn.output_ids), reused_tokens(turn))
        items = self.items if done is not None or error is not None else []
        end = finished_at(turn) if done is not None else None
        return response_body(self.id, self.raw, turn.received_at, status, items, use, error, end)

    def start(self) -> list[Event]:
        body = self._body("in_progress", None)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    # --- text ---

    def _logprobs(self, delta: Delta) -> list[dict[str, Any]]:
        if self.top is None:
            return []
        out = []
        for i, (tid, lp) in enumerate(zip(delta.token_ids, delta.logprobs, strict=False)):
            alts = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
            best = sorted(alts, key=lambda a: -a[1])[: self.top]
            out.append({**self._token(tid), "logprob": lp,
                        "top_logprobs": [{**self._token(a), "logprob": v} for a, v in best]})  # fmt: skip
        return out

    def _token(self, tid: int) -> dict[str, Any]:
        raw = self.tok.token_bytes(tid)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self._open is None:
            self._messages += 1
            suffix = "" if self._messages == 1 else f"_{self._messages}"
            item = message_item(f"msg_{item_ids(self.turn)}{suffix}", "", "in_progress")
            self.items.append(item)
            self._open = len(self.items) - 1
            added = {**item, "content": []}
            events.append(self._event("response.output_item.added", output_index=self._open, item=added))
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=self._open, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [],
                                            "logprobs": []}))  # fmt: skip
        item = self.items[self._open]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._open,
                                  content_index=0, delta=text, logprobs=logprobs))  # fmt: skip
        return events

    def _close(self, status: str) -> list[Event]:
        if self._open is None:
            return []
        index, self._open = self._open, None
        item = self.items[index]
        item["status"] = status
        part = item["content"][0]
        return [
            self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                        content_index=0, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    # --- reasoning ---

    def _reason(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._thinking is None:
            item = reasoning_item(f"rs_{item_ids(self.turn)}", "", "in_progress")
            self.items.append(item)
            self._thinking = len(self.items) - 1
            added = {**item, "content": []}
            events.append(self._event("response.output_item.added", output_index=self._thinking, item=added))
        item = self.items[self._thinking]
        item["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                  output_index=self._thinking, content_index=0, delta=text))  # fmt: skip
        return events

    def _close_reasoning(self, status: str) -> list[Event]:
        if self._thinking is None:
            return []
        index, self._thinking = self._thinking, None
        item = self.items[index]
        item["status"] = status
        return [
            self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=item["content"][0]["text"]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    # --- tool calls ---

    def _call(self, call: ToolCall) -> list[Event]:
        item = call_item(call.id, call.name, call.arguments, "completed")
        self.items.append(item)
        index = len(self.items) - 1
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=call.arguments),
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    # --- the Formatter protocol ---

    def feed(self, delta: Delta) -> list[Event]:
        """The stream events for one ``Delta``; also grows ``items``."""
        events: list[Event] = []
        # a token that shows no text yet (part of a UTF-8 character) counts with the text that follows
        self._pending += self._logprobs(delta)
        if delta.reasoning:
            events += self._reason(delta.reasoning)
            self._pending = []  # the reasoning's own tokens
        if delta.content:
            events += self._close_reasoning("completed")
            events += self._text(delta.content, self._pending)
            self._pending = []
        for call in delta.tool_calls:
            events += self._close_reasoning("completed")
            events += self._close("completed")
            events += self._call(call)
            self._pending = []  # the call's own tokens
        return events

    def _status(self, done: Done) -> str:
        return "incomplete" if done.finish_reason == "length" else "completed"

    def finish(self, done: Done) -> list[Event]:
        status = self._status(done)
        events = self._close_reasoning(status) + self._close(status)
        if status == "incomplete":
            for item in self.items:
                item["status"] = "incomplete"
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self._body(status, done))]

    def response(self, done: Done) -> dict[str, Any]:
        self.finish(done)
        return self._body(self._status(done), done)

    def stream_error(self, exc: Exception) -> str:
        """An error after the headers went out: an ``error`` event, then ``response.failed``."""
        _, body = for_exception(exc)
        err = body["error"]
        failed = self._body("failed", None, {"code": err["code"] or err["type"], "message": err["message"]})
        error = self._event("error", code=err["code"], message=err["message"], param=err["param"])
        return sse(error) + sse(self._event("response.failed", response=failed))

    async def stream(self, events: AsyncIterator[Delta | Done]) -> AsyncIterator[str]:
        for event in self.start():
            yield sse(event)
        async for ev in events:
            for event in self.finish(ev) if isinstance(ev, Done) else self.feed(ev):
                yield sse(event)
