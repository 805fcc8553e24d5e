"""How a turn is stored: what it adds to an earlier turn of its session (its *base*), not the whole.

A session's turns form a prefix tree: turn k+1's prompt is turn k's prompt + turn k's output + the new
tool and user tokens, and its request repeats turn k's messages before the new ones. Storing each turn
whole costs O(turns²) per episode; storing what a turn adds to its base costs O(tokens).

The base is the turn's parent (the turn it extends) or, when it has none, the session's previous turn
(a harness whose template is not prefix-stable still shares most of each prompt). A stored turn holds:

- ``prompt_base``: how many leading prompt ids equal its base's ``prompt_ids + output_ids``, and the
  ids after them (``prompt_ids`` column);
- ``spans_base``: how many leading generated spans equal its base's, and the others;
- its request, whole, or (``request_delta``) as ``{"k": [every key, in order], "s": {key: value}
  (what differs from the base's request), "m": [n, [messages]]}``: the base's first n messages, then
  these (only when the request has a ``messages`` list that starts like the base's). A Responses
  request's ``input`` list is stored the same way, with ``"mk": "input"`` naming the key.

A turn that shares nothing with a base is stored whole (no base), so reading it reads one row.
Values compare as their JSON text, so what is read back is exactly what was written (``1`` vs ``1.0``,
key order).

>>> base = Turn([1, 2, 3], [7, 8], [], {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
>>> turn = Turn([1, 2, 3, 7, 8, 9], [], [(3, 5, 1)], {"model": "m", "messages": [
...     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
>>> enc = encode(turn, base)
>>> enc.prompt_base, enc.prompt_tail, enc.request
(5, [9], {'k': ['model', 'messages'], 's': {}, 'm': [1, [{'role': 'assistant', 'content': 'yo'}]]})
>>> decode(enc, base) == (turn.prompt_ids, turn.spans, turn.request)
True
"""

from __future__ import annotations

import json
from array import array
from dataclasses import dataclass
from typing import Any

Span = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Turn:
    """What a turn's encoding depends on (a base), or what is encoded."""

    prompt_ids: list[int]
    output_ids: list[int]
    spans: list[Span]
    request: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Encoded:
    """A turn as stored, relative to its base (``has_base`` False: stored whole)."""

    has_base: bool
    prompt_base: int
    prompt_tail: list[int]
    spans_base: int
    spans_tail: list[Span]
    request: dict[str, Any]
    request_delta: bool


def pack_ids(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    a = array("I")
    a.frombytes(blob)
    return a.tolist()


def _json(value: object) -> str:
    return json.dumps(value, allow_nan=False)


def shared_prefix(a: list[Any], b: list[Any]) -> int:
    """The length of the longest common prefix of two lists (slice compares: C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _shared_messages(messages: list[Any], base: list[Any]) -> int:
    """How many leading messages are the same JSON as the base's (``==`` alone takes 1 for 1.0)."""
    n = shared_prefix(messages, base)
    if _json(messages[:n]) == _json(base[:n]):
        return n
    return next(i for i in range(n) if _json(messages[i]) != _json(base[i]))


LIST_KEYS = ("messages", "input")
"""Request keys whose list may be stored as the base's first n items plus the rest (one per request)."""


def _request_delta(request: dict[str, Any], base: dict[str, Any]) -> dict[str, Any] | None:
    """The request as a delta from the base's, or None when it shares nothing with it."""
    changed: dict[str, Any] = {}
    kept = 0
    delta: dict[str, Any] = {"k": list(request), "s": changed}
    for key, value in request.items():
        listed = key in LIST_KEYS and "m" not in delta
        if listed and isinstance(value, list) and isinstance(base.get(key), list):
            n = _shared_messages(value, base[key])
            if n:
                delta["m"] = [n, value[n:]]
                if key != "messages":
                    delta["mk"] = key
                kept += 1
                continue
        if key in base and _json(base[key]) == _json(value):
            kept += 1
        else:
            changed[key] = value
    return delta if kept else None


def encode(turn: Turn, base: Turn | None) -> Encoded:
    """What `turn` adds to `base` (None: stored whole)."""
    if base is None:
        return Encoded(False, 0, turn.prompt_ids, 0, turn.spans, turn.request, False)
    prompt_base = shared_prefix(turn.prompt_ids, base.prompt_ids + base.output_ids)
    spans_base = shared_prefix(turn.spans, base.spans)
    delta = _request_delta(turn.request, base.request)
    if not prompt_base and not spans_base and delta is None:
        return encode(turn, None)
    return Encoded(
        True,
        prompt_base,
        turn.prompt_ids[prompt_base:],
        spans_base,
        turn.spans[spans_base:],
        delta if delta is not None else turn.request,
        delta is not None,
    )


def decode_prompt(base: Turn | None, prompt_base: int, tail: list[int]) -> list[int]:
    if base is None or not prompt_base:
        return tail
    head = base.prompt_ids[:prompt_base]
    if prompt_base > len(head):
        head += base.output_ids[: prompt_base - len(head)]
    return head + tail


def decode_request(base: Turn | None, stored: dict[str, Any], delta: bool) -> dict[str, Any]:
    """The whole request. Its first messages are the base's own objects (shared, not copied)."""
    if not delta:
        return stored
    if base is None:
        raise ValueError("a request stored as a delta has no base turn")
    changed, messages, listed = stored["s"], stored.get("m"), stored.get("mk", "messages")
    out: dict[str, Any] = {}
    for key in stored["k"]:
        if key in changed:
            out[key] = changed[key]
        elif key == listed and messages is not None:
            out[key] = base.request[key][: messages[0]] + messages[1]
        else:
            out[key] = base.request[key]
    return out


def decode(enc: Encoded, base: Turn | None) -> tuple[list[int], list[Span], dict[str, Any]]:
    """Prompt ids, generated spans and request, whole again."""
    spans = base.spans[: enc.spans_base] + enc.spans_tail if base is not None else enc.spans_tail
    prompt = decode_prompt(base, enc.prompt_base, enc.prompt_tail)
    return prompt, spans, decode_request(base, enc.request, enc.request_delta)
