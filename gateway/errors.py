"""One table of error handlers: the exception tree → OpenAI error JSON.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` and the message says what to
change. Anything unexpected is logged with its traceback and answered with a 500 that says so.
Under the Anthropic routes (``/v1/messages…``) the same status and message go out in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}`` (``anthropic_error``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from belayer.errors import EngineTimeout, EngineUnavailable, RequestError, StoreError

log = logging.getLogger("belayer.gateway")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def for_exception(exc: Exception) -> tuple[int, dict[str, Any]]:
    """Status and body for any exception (also used for errors inside an SSE stream)."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(str(exc), exc.error_type, exc.param, exc.code)
    if isinstance(exc, EngineTimeout):
        return 504, error_body(f"{exc}; retry the request", "server_error", None, "engine_timeout")
    if isinstance(exc, EngineUnavailable):
        return 503, error_body(
            f"{exc}; retry the request shortly", "service_unavailable", None, "engine_unavailable"
        )
    if isinstance(exc, StoreError):
        return 500, error_body(
            f"{exc}; the trajectory store failed, check the gateway's disk", "server_error"
        )
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return exc.status_code, error_body(str(exc.detail), kind)
    log.exception("unexpected error", exc_info=exc)
    return 500, error_body(f"internal error ({type(exc).__name__}); see the gateway log", "server_error")


# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors); other statuses
# are invalid_request_error below 500 and api_error from 500 up.
ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH = re.compile(r"/v1/messages(/|$)")


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A ``for_exception`` body in Anthropic's shape (for the Messages routes and their SSE streams)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


async def _handle(request: Request, exc: Exception) -> Response:
    status, body = for_exception(exc)
    if ANTHROPIC_PATH.search(request.url.path):
        body = anthropic_error(status, body)
    return JSONResponse(body, status_code=status)


def handlers() -> dict[Any, Callable[[Request, Exception], Coroutine[Any, Any, Response]]]:
    return {
        cls: _handle
        for cls in (RequestError, EngineUnavailable, EngineTimeout, StoreError, HTTPException, Exception)
    }
