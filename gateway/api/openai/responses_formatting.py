"""``Delta``/``Done`` events → an OpenAI Responses object, or the SSE event sequence of a streamed one.

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
from gateway.api.openai.responses import (
    call_item,
    finished_at,
    item_ids,
    message_item,
    reasoning_item,
    response_body,
    response_id,
    reused_tokens,
    usage,
)
from gateway.http.errors import for_exception
from gateway.policy.streaming import ToolCall
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.protocol import Delta, Done, GenerationRequest
from store import TurnRecord

Event = dict[str, Any]


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
