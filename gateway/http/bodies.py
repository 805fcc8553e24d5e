"""Request bodies: read a JSON object under the size limit, and validate it against a wire model; every
failure is an `InvalidRequest` (or `RequestTooLarge`) that says what to send instead.

Only values that round-trip through the store and every response get in (``check_storable``): a body
with a non-finite number (``NaN``, ``Infinity``, ``1e400``), a lone UTF-16 surrogate (``"\\ud800"``) or
nesting deeper than ``MAX_DEPTH`` is refused here, before anything is written, on every JSON route.

>>> check_storable({"a": [1, 2.5, "x"]})
>>> check_storable({"reward": float("inf")})
Traceback (most recent call last):
...
core.errors.InvalidRequest: 'reward' is not a finite number; JSON numbers must be finite (no NaN, Infinity or 1e400)
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from core.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType

M = TypeVar("M", bound=BaseModel)

OFF_LOOP_BYTES = 256 * 1024
"""Bodies larger than this are parsed off the event loop."""
MAX_DEPTH = 64
"""Deepest nesting of objects and arrays a body may have (tool schemas need a dozen levels)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json(request: Request, limit: int, *, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object, enforcing the size limit while reading (never after: a
    body over the limit is not held in memory). With `optional`, an empty body is ``{}``. (A body
    declared as another media type than JSON never gets here: ``gateway.http.access`` refuses it.)"""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if optional:
            return {}
        raise InvalidRequest("the request body is empty; send a JSON object", code="invalid_json")
    if len(raw) > OFF_LOOP_BYTES:  # parse and check a large body in a thread: the loop serves others
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A JSON object that round-trips (``check_storable``), or the `InvalidRequest` that says why not."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep("") from None
    except ValueError as e:
        raise InvalidRequest(
            f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    check_storable(body)
    return body


def check_json_media_type(content_type: str | None) -> None:
    """Refuse a media type that is not JSON (``application/json`` or ``application/*+json``), or none
    (`content_type` None, for a request that has a body: a blind ``no-cors`` POST may send one bare).

    >>> check_json_media_type("application/json; charset=utf-8")
    >>> check_json_media_type("text/plain")
    Traceback (most recent call last):
    ...
    core.errors.UnsupportedMediaType: the request body is declared as 'text/plain'; send it as JSON with 'Content-Type: application/json'
    """
    if content_type is None:
        raise UnsupportedMediaType(
            "the request has a body but no Content-Type; send it as JSON with 'Content-Type: application/json'",
            code="unsupported_media_type",
        )
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaType(
        f"the request body is declared as {media!r}; send it as JSON with 'Content-Type: application/json'",
        code="unsupported_media_type",
    )


def _no_constant(name: str) -> Any:
    raise InvalidRequest(
        f"the request body holds {name}, which is not a JSON number; send finite numbers only",
        code="invalid_json",
    )


def check_storable(value: Any, where: str = "") -> None:
    """Refuse what the store or a response could not hold: non-finite floats, lone surrogates (in
    keys too), nesting deeper than ``MAX_DEPTH``. Iterative, so depth costs no recursion."""
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise InvalidRequest(
                f"'{path}' is not a finite number; JSON numbers must be finite (no NaN, Infinity or 1e400)",
                param=path or None,
                code="invalid_value",
            )
        if isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                raise _too_deep(path)
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str):
                    _check_text(key, path)
                stack.append((child, f"{path}.{key}" if path else str(key), depth + 1))


def _check_text(text: str, path: str) -> None:
    # isascii() reads a flag CPython keeps (no scan): most text, and all of a large English prompt,
    # skips the regex, which costs ~50 ms per 12 MB on this event loop's GIL.
    if not text.isascii() and _SURROGATE.search(text):
        raise InvalidRequest(
            f"'{path or 'body'}' holds a lone UTF-16 surrogate (e.g. \\ud800), which is not text; "
            "send valid Unicode",
            param=path or None,
            code="invalid_value",
        )


def _too_deep(path: str) -> InvalidRequest:
    return InvalidRequest(
        f"the request body nests objects and arrays deeper than {MAX_DEPTH} levels"
        + (f" (at '{path}')" if path else "")
        + "; send a flatter body",
        param=path or None,
        code="invalid_json",
    )


def _too_large(size: int, limit: int) -> RequestTooLarge:
    return RequestTooLarge(
        f"the request body is {size} bytes, over the gateway's limit of {limit} bytes; send a shorter request "
        "or raise --max-body-bytes",
        code="request_too_large",
    )


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(
            f"invalid value for '{loc}': {first['msg']} ({e.error_count()} error(s) in total)",
            param=loc or None,
            code="invalid_type" if "type" in first["type"] else "invalid_value",
        ) from e
