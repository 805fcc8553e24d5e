"""JSON on the token path, through ``orjson``: a stream chunk to a client, an engine's stream event.

``orjson`` encodes a chunk several times faster than ``json.dumps``, and decodes an engine event
faster than ``json.loads``. Where it would differ from the standard library, the standard library
answers instead, so that what a client or the store sees stays the same:

- `dumps` falls back to ``json.dumps`` for what ``orjson`` refuses (an integer beyond 64 bits, a key
  that is not a string) and for non-finite floats, which ``orjson`` writes as ``null``;
- `loads` is for engine output only (token ids and logprobs); ``orjson`` reads an integer beyond 64
  bits as a float, so request bodies keep ``json.loads`` (`gateway.http.bodies`).

Output is compact (``separators=(",", ":")``) UTF-8, as ``json.dumps(..., ensure_ascii=False)``.

>>> dumps({"a": [1, 2.5, "é"]})
b'{"a":[1,2.5,"\\xc3\\xa9"]}'
>>> sse_data({"x": 1})
'data: {"x":1}\\n\\n'
>>> dumps({"lp": float("-inf")})
b'{"lp":-Infinity}'
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON (see the module docstring for where ``json.dumps`` answers)."""
    try:
        out = orjson.dumps(value)
    except TypeError:
        return _slow(value)
    if b"null" in out and _has_non_finite(value):
        return _slow(value)
    return out


def dumps_str(value: Any) -> str:
    return dumps(value).decode()


def sse_data(value: Any) -> str:
    """One server-sent event carrying `value`: ``data: {...}`` and a blank line."""
    return f"data: {dumps(value).decode()}\n\n"


def loads(raw: bytes | str) -> Any:
    """Parse engine output (raises ``ValueError`` on bad JSON, as ``json.loads`` does)."""
    return orjson.loads(raw)


def _slow(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _has_non_finite(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False
