"""One turn's output pipeline: the engine's chunks become the client's deltas, and its end the turn's
text, tool calls and finish reason.

Each token goes through the detokenizer, then the stop strings (``gateway.policy.streaming``), then the
model family's reasoning parser and tool parser (``gateway.policy.parsers``). Tokens are taken one at a
time, so that a stop string ends the output at exactly the token the engine itself would stop at: a
`Delta` carries the tokens taken, which are the turn's (the turn runner hands them to its stream).

Example::

    out = TurnOutput.of(settings, tokenizer, req, params, report)
    delta = out.feed(chunk)          # visible text, finished tool calls, the tokens taken
    if out.stopped: ...              # a stop string ended the output inside this chunk
    tail, finish = out.end(None)     # what the parsers held back, and why the output ended
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from core.events import ToolCallParseError
from engine_pool.engine.client import SamplingParams, TokenChunk
from gateway.policy.parsers import (
    SPECIAL_TAGS,
    ContentDelta,
    MalformedToolCall,
    ReasoningDelta,
    ReasoningParser,
    ToolCall,
    ToolParser,
    make_reasoning_parser,
    make_tool_parser,
)
from gateway.policy.streaming import StopTrimmer
from gateway.policy.tokenization import ChatTokenizer, IncrementalDetokenizer
from gateway.turns.protocol import Delta, GenerationRequest, Report, TurnSettings


@dataclass(slots=True)
class TurnOutput:
    """The pipeline (detokenizer → stop strings → reasoning parser → tool parser), and what it made."""

    detok: IncrementalDetokenizer
    trimmer: StopTrimmer
    parser: ToolParser
    reasoner: ReasoningParser | None = None
    report: Report | None = None
    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish: str = "stop"
    """The engine's latest finish reason."""

    @classmethod
    def of(
        cls, settings: TurnSettings, tok: ChatTokenizer, req: GenerationRequest, params: SamplingParams,
        report: Report,
    ) -> TurnOutput:  # fmt: skip
        """The pipeline of `req`'s turn; its forced prefix (``tool_choice``) is fed to the tool parser."""
        chat = req.messages is not None  # raw completions are raw text
        out = cls(
            tok.detokenizer(special=settings.tool_call_parser in SPECIAL_TAGS and chat),
            StopTrimmer(params.stop),
            make_tool_parser(settings.tool_call_parser, req.tools, req.parse_tools),
            # chat turns only; a forced tool call starts with no reasoning
            make_reasoning_parser(settings.reasoning_parser if chat else None)
            if not req.forced_prefix
            else None,
            report,
        )
        out.parser.feed(req.forced_prefix)
        return out

    @property
    def stopped(self) -> bool:
        """A stop string ended the output."""
        return self.trimmer.stopped

    def feed(self, chunk: TokenChunk) -> Delta:
        """A chunk's visible text and finished tool calls, and the tokens taken (up to a stop string)."""
        pieces = []
        n = 0
        for t in chunk.token_ids:
            n += 1
            pieces.append(self.trimmer.feed(self.detok.step(t)))
            if self.trimmer.stopped:
                break
        self.finish = chunk.finish_reason or self.finish
        delta = self._delta(self.parse("".join(pieces)))
        delta.token_ids, delta.logprobs = chunk.token_ids[:n], chunk.logprobs[:n]
        delta.top_logprobs = chunk.top_logprobs[:n]
        return delta

    def end(self, finished: str | None) -> tuple[Delta | None, str]:
        """At the end of the stream: what the stop strings and the parsers held back (None: nothing),
        and why the output ended (`finished`: the reason found when a worker was lost after the output
        was complete)."""
        tail = self._delta(self.parse(self.trimmer.finish(), final=True))
        finish = "stop" if self.trimmer.stopped else finished or self.finish
        finish = "tool_calls" if self.parser.calls and finish == "stop" else finish
        return (tail if tail.content or tail.tool_calls or tail.reasoning else None), finish

    def parse(self, text: str, final: bool = False) -> list[Any]:
        """The parsers' events for the next visible text (``final``: and what they held back)."""
        if self.reasoner is None:
            return self.parser.feed(text) + (self.parser.finish() if final else [])
        events: list[Any] = []
        for ev in self.reasoner.feed(text) + (self.reasoner.finish() if final else []):
            events += [ev] if isinstance(ev, ReasoningDelta) else self.parser.feed(ev.text)
        return events + (self.parser.finish() if final else [])

    def _delta(self, events: list[Any]) -> Delta:
        delta = Delta("", [], [], [], [])
        for ev in events:
            if isinstance(ev, ContentDelta):
                delta.content += ev.text
            elif isinstance(ev, ReasoningDelta):
                delta.reasoning += ev.text
            elif isinstance(ev, ToolCall):
                delta.tool_calls.append(ev)
            elif isinstance(ev, MalformedToolCall) and self.report is not None:
                self.report(ToolCallParseError(ev.raw, ev.reason))
        self.content.append(delta.content)
        self.reasoning.append(delta.reasoning)
        return delta
