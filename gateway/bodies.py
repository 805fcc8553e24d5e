"""Request bodies: read a JSON object under the size limit, and validate it against a wire model; every
failure is an `InvalidRequest` (or `RequestTooLarge`) that says what to send instead."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from core.errors import InvalidRequest, RequestTooLarge

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int, *, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object, enforcing the size limit while reading (never after: a
    body over the limit is not held in memory). With `optional`, an empty body is ``{}``."""
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
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(
            f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    return body


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
