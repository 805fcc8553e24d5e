"""Prefix reuse: how a turn's prompt ids are built from the turn its messages extend.

When turn k+1's messages extend turn k's messages and its response, turn k+1's prompt ids are turn k's
prompt ids + turn k's generated ids + the tokenization of only what follows (the end-of-turn marker
when the model did not emit it, and the new messages). Generated tokens are never re-tokenized.

Matching is by a chain hash over the canonical form of each message (what the template renders:
role, content, tool calls' names and arguments; not tool call ids). Every finished turn stores the
chain hash of ``messages + [its response]`` as its *ext key*, so finding the turn a request extends
is one indexed look-up over the request's assistant messages (`SessionManager.plan` reads it with the
session). A request that extends an older turn, or none, opens a new branch: the rewritten history and
the original both stay readable.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.policy.parsers import think_text
from gateway.policy.tokenization import ChatTokenizer
from store import TurnRecord
from store.base import TURN_COMPLETE
from store.roles import TurnReads


def canonical_message(message: dict[str, Any]) -> str:
    calls = [[tc["function"]["name"], tc["function"]["arguments"]] for tc in message.get("tool_calls") or []]
    content = message.get("content") or ""
    if message.get("reasoning_content"):  # a turn's response: as reasoning sent back renders (<think>)
        content = think_text(message["reasoning_content"], content)
    body = {"role": message["role"], "content": content, "tool_calls": calls}
    return json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _h(prev: bytes, text: str) -> bytes:
    return hashlib.blake2b(prev + text.encode(), digest_size=16).digest()


def chain_keys(
    tools: list[dict[str, Any]] | None, messages: list[dict[str, Any]], prev: str | None = None
) -> list[str]:
    """Chain hash after each message; the tools are the chain's root (they render into the prompt).
    ``prev`` continues an existing chain."""
    if prev is None:
        h = _h(b"", json.dumps(tools or [], sort_keys=True, ensure_ascii=False))
    else:
        h = bytes.fromhex(prev)
    keys = []
    for m in messages:
        h = _h(h, canonical_message(m))
        keys.append(h.hex())
    return keys


@dataclass(frozen=True, slots=True)
class PromptPlan:
    prompt_ids: list[int]
    gen_spans: list[tuple[int, int, int]]
    """(start, end, turn id): prompt tokens that are exactly turn `id`'s generated tokens."""
    parent: TurnRecord | None
    reused_tokens: int
    reason: str
    rewritten: list[tuple[int, int]] = field(default_factory=list)
    """Prompt tokens of assistant messages that no earlier turn generated as they are now (a harness
    rewrote them, or they were re-tokenized differently); their logprobs are recomputed."""


class PromptBuilder:
    """A request's prompt ids, given the turn it extends (if any): that turn's exact tokens reused."""

    def __init__(self, store: TurnReads, tokenizer: ChatTokenizer) -> None:
        self.store = store
        self.tok = tokenizer

    def build(
        self,
        session_id: str,
        parent: TurnRecord | None,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        keys: list[str],
    ) -> PromptPlan:
        """The prompt for `messages` (`keys`: their chain keys), extending `parent` when its tokens are
        a prefix of the rendered prompt."""
        last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        full_text = self.tok.render(messages, tools, add_generation_prompt=True)
        if parent is not None:
            j = keys.index(str(parent.ext_key))
            spliced = self._extend(parent, messages, j, tools, full_text, j + 1 <= last)
            if spliced is not None:
                plan, tail_char, offsets = spliced
                return self._identify(plan, session_id, messages, tools, full_text, j + 1, tail_char, offsets)
        reason = (
            "no earlier turn is a prefix of these messages"
            if parent is None
            else "template not prefix-stable"
        )
        ids, offsets = self._encode(full_text, last >= 0)
        plan = PromptPlan(ids, [], None, 0, reason)
        return self._identify(plan, session_id, messages, tools, full_text, 0, 0, offsets)

    def _encode(self, text: str, offsets: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids, and their character offsets only when `_identify` will need them."""
        return self.tok.encode_with_offsets(text) if offsets else (self.tok.encode(text), [])

    def _identify(
        self,
        plan: PromptPlan,
        session_id: str,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        full_text: str,
        first: int,
        seg_char: int,
        offsets: list[tuple[int, int]],
    ) -> PromptPlan:
        """Find the tokens of the assistant messages from `first` on, in the part of the prompt that
        was tokenized from text (``full_text[seg_char:]``, with each token's `offsets` in it): those
        that an earlier turn generated exactly keep that turn's identity (a generated span); the
        others are marked rewritten."""
        later = [j for j in range(first, len(messages)) if messages[j]["role"] == "assistant"]
        if not later or not offsets:
            return plan
        seg_token = plan.reused_tokens  # the tokenized text is the prompt after the reused tokens
        starts, ends = [a for a, _ in offsets], [b for _, b in offsets]
        spans, rewritten = list(plan.gen_spans), list(plan.rewritten)
        generated: dict[str, TurnRecord] | None = None
        for j in later:
            before = self.tok.render(messages[:j], tools, add_generation_prompt=True)
            through = self.tok.render(messages[: j + 1], tools, add_generation_prompt=False)
            if not (through.startswith(before) and full_text.startswith(through)):
                continue
            eot = through.rfind(self.tok.eos_token)
            if eot < len(before):
                continue
            start, end = len(before) - seg_char, eot + len(self.tok.eos_token) - seg_char
            candidates = range(bisect.bisect_left(starts, start), bisect.bisect_right(ends, end))
            inside = [i for i in candidates if starts[i] >= start and ends[i] > starts[i]]
            if not inside:
                continue
            a, b = seg_token + inside[0], seg_token + inside[-1] + 1
            if generated is None:  # what each earlier turn answered, by its canonical message
                generated = {
                    canonical_message(t.response["message"]): t
                    for t in self.store.get_turns(session_id)
                    if t.response is not None and t.status == TURN_COMPLETE
                }
            source = generated.get(canonical_message(messages[j]))
            out = source.output_ids if source is not None else []
            if out and plan.prompt_ids[a : a + len(out)] == out:
                spans.append((a, a + len(out), source.id))  # type: ignore[union-attr]
                a += len(out)
            if a < b:
                rewritten.append((a, b))
        spans.sort()
        return replace(plan, gen_spans=spans, rewritten=rewritten)

    def _extend(
        self,
        parent: TurnRecord,
        messages: list[dict[str, Any]],
        j: int,
        tools: list[dict[str, Any]] | None,
        full_text: str,
        offsets_needed: bool,
    ) -> tuple[PromptPlan, int, list[tuple[int, int]]] | None:
        """Splice: parent prompt + parent output + tokens of the text after the parent's turn. Also
        returns where that text starts in `full_text` and its tokens' offsets (when `offsets_needed`:
        an assistant message follows the parent's)."""
        before = self.tok.render(messages[:j], tools, add_generation_prompt=True)
        through = self.tok.render(messages[: j + 1], tools, add_generation_prompt=False)
        if not (through.startswith(before) and full_text.startswith(through)):
            return None
        region = through[len(before) :]  # the rendered assistant turn, end-of-turn marker included
        eot = region.rfind(self.tok.eos_token)
        if eot < 0:
            return None
        ended = bool(parent.output_ids) and parent.output_ids[-1] in self.tok.eos_ids
        tail = region[eot + len(self.tok.eos_token) if ended else eot :] + full_text[len(through) :]
        base = parent.prompt_ids + parent.output_ids
        spans = [*parent.prompt_gen_spans, (len(parent.prompt_ids), len(base), parent.id)]
        tail_ids, offsets = self._encode(tail, offsets_needed)
        plan = PromptPlan(base + tail_ids, spans, parent, len(base), f"extends turn {parent.index}")
        return plan, len(full_text) - len(tail), offsets
