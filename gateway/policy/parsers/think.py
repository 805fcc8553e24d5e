"""Reasoning in ``<think>…</think>`` (vLLM's ``--reasoning-parser qwen3`` and ``deepseek_r1``).

``qwen3``: reasoning only when the reply opens with ``<think>`` (after whitespace); otherwise the whole
reply is content. ``deepseek_r1``: the reply starts in reasoning (its template opens ``<think>`` in the
prompt), an opening ``<think>`` is skipped if the model writes one anyway, and everything before
``</think>`` is reasoning. Reasoning that never closes (the token limit) stays reasoning: it was
streamed as such. The text after ``</think>`` is content, as generated, so that
``<think>{reasoning}</think>{content}`` is the reply when the reply opened the tag itself (the form
the Messages and Responses routes render thinking blocks and reasoning items back into).

>>> p = ThinkReasoningParser(implicit_start=False)
>>> p.feed("<think>hm</thi") + p.feed("nk>Hi") + p.finish()
[ReasoningDelta(text='hm'), ContentDelta(text='Hi')]
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policy.parsers.base import ContentDelta, ReasoningDelta, ReasoningEvent, partial_suffix

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(slots=True)
class ThinkReasoningParser:
    """Splits ``<think>…</think>`` off the front of a reply, incrementally."""

    implicit_start: bool
    """deepseek_r1: text before ``</think>`` is reasoning even with no ``<think>``."""
    _state: str = "start"  # start (the opening tag may still come), thinking, content
    _buf: str = ""

    def feed(self, text: str) -> list[ReasoningEvent]:
        self._buf += text
        events: list[ReasoningEvent] = []
        if self._state == "start":
            head = self._buf.lstrip()
            if THINK_OPEN.startswith(head) and len(head) < len(THINK_OPEN):
                return events  # "", "<", "<th"…: may still be the opening tag
            if head.startswith(THINK_OPEN):
                self._buf, self._state = head[len(THINK_OPEN) :], "thinking"
            else:
                self._state = "thinking" if self.implicit_start else "content"
        if self._state == "thinking":
            at = self._buf.find(THINK_CLOSE)
            if at < 0:
                keep = partial_suffix(self._buf, THINK_CLOSE)
                self._reason(self._buf[: len(self._buf) - keep], events)
                self._buf = self._buf[len(self._buf) - keep :]
                return events
            self._reason(self._buf[:at], events)
            self._buf, self._state = self._buf[at + len(THINK_CLOSE) :], "content"
        if self._buf:
            events.append(ContentDelta(self._buf))
        self._buf = ""
        return events

    def finish(self) -> list[ReasoningEvent]:
        events: list[ReasoningEvent] = []
        if self._buf:
            thinking = self._state == "thinking" or (self._state == "start" and self.implicit_start)
            events.append(ReasoningDelta(self._buf) if thinking else ContentDelta(self._buf))
        self._buf = ""
        return events

    @staticmethod
    def _reason(text: str, events: list[ReasoningEvent]) -> None:
        if text:
            events.append(ReasoningDelta(text))


def qwen3() -> ThinkReasoningParser:
    return ThinkReasoningParser(implicit_start=False)


def deepseek_r1() -> ThinkReasoningParser:
    return ThinkReasoningParser(implicit_start=True)


def think_text(reasoning: str, content: str) -> str:
    """A reply's text with its reasoning put back: how reasoning that a client sends back (a
    thinking block, a reasoning item, ``reasoning_content``) is rendered, and the form of a turn's
    response that a next request is matched against."""
    return f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}"
